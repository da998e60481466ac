"""The OpenAI-compatible serving gateway in front of the vLLM replicas.

It asks each replica for what training needs (prompt and completion token ids, the
sampled tokens' logprobs, routed experts where the engine has them), answers the
client in plain OpenAI shape plus `completion_id`, and records every completion as a
trajectory and every request (served or failed) as a request record on Kafka.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from liverl.contracts import AliasName, Id, SamplingParams, new_id
from liverl.http import MalformedJSON, read_json, service_app
from liverl.keys import KeyRecord, require_admin, require_key
from liverl.load import GatewayLoad
from liverl.pool import (
    ROLLOUT,
    SERVED_MODEL_NAME,
    UNIX,
    Pool,
    Replica,
    pool_file,
    read_pool,
    replica_tls,
)
from liverl.ratelimit import TenantRateLimiter
from liverl.settings import Settings, get_settings
from serving.recorder import Accumulator, Exchange, Recorder


def replica_session(url: str, timeout: float) -> aiohttp.ClientSession:
    """The gateway's client to one replica: aiohttp, whose C parser took the gateway's CPU
    per request from 2.5 to 1.5 ms where httpx's was its largest share (docs/benchmarks.md,
    The gateway's cost to serving)."""
    if url.startswith(UNIX):
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=url[len(UNIX):], limit=0)
        url = "http://replica"
    else:
        connector = aiohttp.TCPConnector(limit=0, ssl=replica_tls())
    return aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(
        total=None, sock_connect=timeout, sock_read=timeout),
        read_bufsize=4 * 1024 * 1024)  # a streamed line may carry a chunk's routed experts


class NoReplica(Exception):
    pass


class Unroutable(Exception):
    """A request for an alias the gateway cannot serve: `status` and why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# --- What a request may ask: the fields the gateway reads or records are checked before
# anything is forwarded; anything else is vLLM's to accept or refuse (it is forwarded).
class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    prompt: str | list[int] = Field(description="Text, or token ids.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16, description="Choices; each is recorded as its own completion.")
    logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = None
    stream: bool = False
    return_routed_experts: bool = Field(False, description=(
        "Also answer with the experts each MoE layer routed every token to (base64 of a .npy "
        "[prompt + completion - 1 tokens, MoE layers, top_k], vLLM's field); streamed: in one "
        "chunk before [DONE]. Every trajectory records them either way."))

    def prompt_text(self) -> str:
        return str(self.prompt)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              max_tokens=self.max_tokens, seed=self.seed)


class ChatRequest(CompletionRequest):
    # Chat has no prompt: pydantic lets a subclass narrow the field to None, mypy calls it an incompatible override.
    prompt: None = Field(None, exclude=True)  # type: ignore[assignment]
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def prompt_text(self) -> str:
        return json.dumps(self.messages)


GROUP_ID = TypeAdapter(Id)  # a group id is recorded as an id: checked like one
ALIAS = TypeAdapter(AliasName)


def request_schema(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


class Router:
    """Least-in-flight routing over the enabled replicas of the pool file."""

    LOAD_WINDOW_S = 5.0

    def __init__(self, settings: Settings):
        self.settings = settings
        self.inflight: Tally[str] = Tally()
        self.waiting = 0
        self.routed: deque[float] = deque()  # monotonic times of the last LOAD_WINDOW_S's requests
        self.answered: deque[tuple[float, int]] = deque()  # (monotonic time, completion tokens), same window
        self._pool = Pool()
        self._mtime: int | None = None

    def forget_routed(self, now: float) -> None:
        while self.routed and self.routed[0] < now - self.LOAD_WINDOW_S:
            self.routed.popleft()
        while self.answered and self.answered[0][0] < now - self.LOAD_WINDOW_S:
            self.answered.popleft()

    def tokens_answered(self, tokens: int) -> None:
        now = time.monotonic()
        self.answered.append((now, tokens))
        self.forget_routed(now)

    def load(self) -> GatewayLoad:
        self.forget_routed(time.monotonic())
        return GatewayLoad(in_flight={name: n for name, n in self.inflight.items() if n},
                           waiting=self.waiting, requests_per_s=len(self.routed) / self.LOAD_WINDOW_S,
                           tokens_per_s=sum(tokens for _, tokens in self.answered) / self.LOAD_WINDOW_S,
                           window_s=self.LOAD_WINDOW_S)

    def pool(self) -> Pool:
        try:
            mtime = pool_file(self.settings).stat().st_mtime_ns
        except FileNotFoundError:
            return self._pool
        if mtime != self._mtime:
            self._pool, self._mtime = read_pool(self.settings), mtime
        return self._pool

    def for_session(self, pool: Pool, enabled: list[Replica], session: str | None) -> list[Replica]:
        """The replicas this session may use: while a canary is judged, `canary_share` of
        the sessions get it and the rest stable, each session always the same side (a
        user does not flip between versions); without a session, each request is drawn."""
        canary = pool.aliases.get("canary")
        on_canary = [r for r in enabled if r.policy_version == canary]
        if not on_canary or len(on_canary) == len(enabled):
            return enabled
        digest = hashlib.blake2b(session.encode(), digest_size=8).digest() if session else None
        bucket = int.from_bytes(digest, "big") / 2**64 if digest else random.random()
        if bucket < self.settings.serving.canary_share:
            return on_canary
        return [r for r in enabled if r.policy_version != canary]

    async def pick(self, session: str | None = None, alias: str | None = None) -> Replica:
        """The least busy enabled replica for the session, or for the version `alias` names;
        while a swap has none enabled, wait for one."""
        now = time.monotonic()
        deadline = now + self.settings.serving.no_replica_wait_s
        self.routed.append(now)
        self.forget_routed(now)
        self.waiting += 1
        try:
            while True:
                pool = self.pool()  # one look at the pool file per request
                if alias is None:
                    enabled = [r for r in pool.general if r.enabled]
                else:  # the version's replicas, a team's own included, never one lent to rollouts
                    enabled = [r for r in pool.replicas if r.enabled and r.alias != ROLLOUT
                               and r.policy_version == aliased_version(pool, alias)]
                if enabled:
                    return min(self.for_session(pool, enabled, session), key=lambda r: self.inflight[r.name])
                if time.monotonic() > deadline:
                    raise NoReplica("no replica is serving")
                await asyncio.sleep(0.02)
        finally:
            self.waiting -= 1


def aliased_version(pool: Pool, alias: str) -> str:
    """The version an alias names, if some replica serves it (one being swapped counts:
    the request waits for it like any other)."""
    if alias not in pool.aliases:
        raise Unroutable(404, f"x-liverl-alias: no alias {alias!r} (aliases: {', '.join(sorted(pool.aliases))})")
    version = pool.aliases[alias]
    if not any(r.policy_version == version for r in pool.replicas):
        raise Unroutable(409, f"x-liverl-alias: {alias!r} names {version}, which no replica serves")
    return version


def upstream_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The client's request plus what the trajectory needs from vLLM."""
    body = dict(body, model=SERVED_MODEL_NAME, return_token_ids=True)
    body.pop("return_routed_experts", None)  # the gateway's to answer: the replica returns them always
    if chat:
        body["logprobs"] = True
        body.setdefault("top_logprobs", 0)
    else:
        body["logprobs"] = max(int(body.get("logprobs") or 0), 0)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def client_view(choice: dict[str, Any], asked: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Drop what the client did not ask for, so the answer is plain OpenAI shape."""
    choice = dict(choice)
    if not asked.get("logprobs"):
        choice.pop("logprobs", None)
    if not asked.get("return_token_ids"):
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    if not asked.get("return_routed_experts"):
        choice.pop("routed_experts", None)
    return choice


def routing_only(chunk: dict[str, Any]) -> bool:
    """The chunk a replica adds to a stream to carry its choices' routing (serving/replica_server.py)."""
    choices = chunk.get("choices") or []
    return bool(choices) and all("routed_experts" in c for c in choices)


def refuse(status: int, message: str, kind: str = "invalid_request_error",
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status,
                        headers=headers)

def upstream_error(status: int, content: bytes, headers: dict) -> JSONResponse:
    """The replica's own refusal, with its status, in the shape OpenAI clients read."""
    try:
        payload = json.loads(content)
        if isinstance(payload, dict) and "error" in payload:
            return JSONResponse(payload, status, headers=headers)
        message = json.dumps(payload)
    except ValueError:
        message = content.decode(errors="replace")
    return refuse(status, message[:500] or f"replica answered {status}", "upstream_error", headers)


def for_client(payload: dict[str, Any], body: dict[str, Any], completion_id: str, chat: bool) -> dict[str, Any]:
    """A replica's answer, or one chunk of it, as the client asked for it, named by the completion."""
    payload.update(id=completion_id, completion_id=completion_id, model=body.get("model", SERVED_MODEL_NAME))
    payload["choices"] = [client_view(c, body, chat) for c in payload.get("choices", [])]
    payload.pop("prompt_token_ids", None)
    return payload


class Refused(Exception):
    """A request answered with an error: the answer, and the error its request record keeps."""

    def __init__(self, response: JSONResponse, recorded: str):
        super().__init__(recorded)
        self.response, self.recorded = response, recorded


def refusal(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> Refused:
    return Refused(refuse(status, message, kind, headers), message[:500])


def checked_header(request: Request, name: str, adapter: TypeAdapter) -> str | None:
    value = request.headers.get(name)
    if value is not None:
        try:
            adapter.validate_python(value)
        except ValidationError as error:
            raise refusal(400, f"{name}: {error.errors()[0]['msg']}") from None
    return value


class InFlight:
    """One request's place in its replica's in-flight count, given back exactly once,
    whatever path the request takes."""

    def __init__(self, router: Router, replica: Replica):
        self.counts, self.name = router.inflight, replica.name
        self.counts[self.name] += 1
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.counts[self.name] -= 1


@dataclass
class Upstream:
    """A request a replica answers: its answer as it arrives, its place in the replica's
    in-flight count, and its choices as gathered for the record."""

    response: aiohttp.ClientResponse
    replica: Replica
    in_flight: InFlight
    gathered: Accumulator

    async def close(self) -> None:
        self.response.release()
        self.in_flight.release()


class Gateway:
    """A completion request: validate, route, forward (whole or streamed), record."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.limiter = TenantRateLimiter(settings.serving.tenant_requests_per_s,
                                         settings.serving.tenant_requests_burst)
        self.router = Router(settings)
        self.recorder = Recorder(settings)
        self.clients: dict[str, aiohttp.ClientSession] = {}  # one per replica address (a socket is a transport)

    def client_for(self, replica: Replica) -> aiohttp.ClientSession:
        if replica.url not in self.clients:
            self.clients[replica.url] = replica_session(replica.url, self.settings.serving.request_timeout_s)
        return self.clients[replica.url]

    async def start(self) -> None:
        await self.recorder.start()
        for replica in self.router.pool().replicas:  # made now, not by the first request each one answers
            self.client_for(replica)

    async def stop(self) -> None:
        await self.recorder.stop()
        await asyncio.gather(*(client.close() for client in self.clients.values()))

    async def health(self) -> dict:
        pool = self.router.pool()
        return {"ok": any(r.enabled for r in pool.replicas),
                "replicas": [dict(r.model_dump(include={"name", "policy_version", "enabled"}),
                                  inflight=self.router.inflight[r.name]) for r in pool.replicas]}

    async def complete(self, request: Request, caller: KeyRecord, endpoint: str, chat: bool) -> Response:
        exchange = Exchange(endpoint, caller)
        try:
            body = await self.validate(request, exchange, chat)
            exchange.replica = replica = await self.route(request, body)
            return await self.forward(body, exchange, replica, chat)
        except Refused as refused:
            self.recorder.request(exchange, refused.response.status_code, error=refused.recorded)
            return refused.response

    async def validate(self, request: Request, exchange: Exchange, chat: bool) -> dict[str, Any]:
        """The body, once the caller is within its rate and what will be recorded is valid
        (before anything is forwarded)."""
        tenant = exchange.caller.tenant
        if wait := self.limiter.take(tenant):
            raise refusal(429, f"tenant {tenant!r} is over its rate limit; retry later", kind="rate_limit_error",
                          headers={"Retry-After": str(max(1, int(wait + 0.999)))})
        try:
            body = read_json(await request.body())
        except MalformedJSON as error:
            raise refusal(400, error.detail) from None
        if not isinstance(body, dict):
            raise refusal(400, "the body must be a JSON object")
        try:
            exchange.asked = (ChatRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as error:
            e = error.errors()[0]
            raise refusal(400, f"{'.'.join(map(str, e['loc']))}: {e['msg']}") from None
        # Completions sampled for one prompt (rollout groups) share this header.
        exchange.group_id = checked_header(request, "x-liverl-group-id", GROUP_ID)
        return body

    async def route(self, request: Request, body: dict[str, Any]) -> Replica:
        alias = checked_header(request, "x-liverl-alias", ALIAS)  # a team's name for a version: only it answers
        session = request.headers.get("x-liverl-session") or body.get("user")
        try:
            return await self.router.pick(str(session) if session is not None else None, alias)
        except NoReplica as error:
            raise refusal(503, str(error), kind="service_unavailable") from None
        except Unroutable as error:
            raise refusal(error.status, str(error)) from None

    async def forward(self, body: dict[str, Any], exchange: Exchange, replica: Replica, chat: bool) -> Response:
        gathered = Accumulator(new_id("cmpl"))
        headers = {"x-liverl-policy-version": replica.policy_version,
                   "x-liverl-completion-id": gathered.completion_id, "x-liverl-replica": replica.name}
        http = self.client_for(replica)
        in_flight = InFlight(self.router, replica)
        try:
            response = await http.post(f"/v1/{'chat/completions' if chat else 'completions'}",
                                       json=upstream_body(body, chat))
        except (aiohttp.ClientError, TimeoutError) as error:
            in_flight.release()
            raise Refused(refuse(502, f"replica {replica.name} failed: {error!r}", "upstream_error"),
                          repr(error)) from None
        except BaseException:
            in_flight.release()
            raise
        upstream = Upstream(response, replica, in_flight, gathered)
        if response.status != 200:
            try:
                content = await response.read()
            finally:
                await upstream.close()
            raise Refused(upstream_error(response.status, content, headers),
                          content.decode(errors="replace")[:500])
        if exchange.stream:
            return StreamingResponse(self.relay(upstream, body, exchange, chat),
                                     media_type="text/event-stream", headers=headers)
        return await self.answer_whole(upstream, body, exchange, chat, headers)

    async def answer_whole(self, upstream: Upstream, body: dict[str, Any], exchange: Exchange, chat: bool,
                           headers: dict[str, str]) -> JSONResponse:
        gathered = upstream.gathered
        try:
            payload = json.loads(await upstream.response.read())
            gathered.add(payload, chat)
        except (ValueError, TypeError, AttributeError) as error:
            raise Refused(refuse(502, f"replica {upstream.replica.name} answered something unreadable",
                                 "upstream_error"), f"unreadable replica answer: {error!r}"[:500]) from None
        finally:
            await upstream.close()
        self.record(exchange, gathered, first_token=None)
        return JSONResponse(for_client(payload, body, gathered.completion_id, chat), headers=headers)

    async def relay(self, upstream: Upstream, body: dict[str, Any], exchange: Exchange,
                    chat: bool) -> AsyncIterator[bytes]:
        gathered, first_token = upstream.gathered, None
        try:
            async for raw in upstream.response.content:  # line by line
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                gathered.add(chunk, chat)
                first_token = first_token or time.perf_counter()
                if not chunk.get("choices") and not body.get("stream_options"):
                    continue  # the usage chunk we asked for, the client did not
                if routing_only(chunk) and not body.get("return_routed_experts"):
                    continue
                yield f"data: {json.dumps(for_client(chunk, body, gathered.completion_id, chat))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:  # recorded before closing: a client's hang-up may cancel the close
            self.record(exchange, gathered, first_token)
            await upstream.close()

    def record(self, exchange: Exchange, gathered: Accumulator, first_token: float | None) -> None:
        self.router.tokens_answered(gathered.tokens())
        self.recorder.completion(exchange, gathered, first_token)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        yield
        await gateway.stop()

    app = service_app("liverl gateway", settings, gateway.health, lifespan)

    @app.post("/v1/completions", openapi_extra=request_schema(CompletionRequest))
    async def completions(request: Request, caller: KeyRecord = Depends(require_key)):
        return await gateway.complete(request, caller, "completions", chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_schema(ChatRequest))
    async def chat_completions(request: Request, caller: KeyRecord = Depends(require_key)):
        return await gateway.complete(request, caller, "chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(caller: KeyRecord = Depends(require_key)) -> dict:
        versions = sorted({r.policy_version for r in gateway.router.pool().replicas})
        return {"object": "list", "data": [
            {"id": SERVED_MODEL_NAME, "object": "model", "owned_by": "liverl", "versions": versions}
        ]}

    @app.get("/admin/load")
    async def load(caller: KeyRecord = Depends(require_admin)) -> GatewayLoad:
        """Production requests in flight per replica, waiting, routed per second, tokens per second."""
        return gateway.router.load()

    return app


if __name__ == "__main__":
    from liverl.process import serve

    settings = get_settings()
    serve(create_app(settings), settings.host, settings.ports.gateway)
