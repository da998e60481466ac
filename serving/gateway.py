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
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from liverl.contracts import (
    AliasName,
    Id,
    RequestRecord,
    SamplingParams,
    Topics,
    Trajectory,
    new_id,
)
from liverl.http import MalformedJSON, read_json, service_app
from liverl.kafka import encode, make_producer
from liverl.keys import KeyRecord, require_admin, require_key
from liverl.load import GatewayLoad
from liverl.observability import log, setup_logging
from liverl.pool import (
    ROLLOUT,
    SERVED_MODEL_NAME,
    Pool,
    Replica,
    pool_file,
    read_pool,
    replica_async_client,
)
from liverl.ratelimit import TenantRateLimiter
from liverl.settings import Settings, get_settings

REQUESTS = Counter("liverl_gateway_requests_total", "Requests", ["endpoint", "status", "version"])
LATENCY = Histogram("liverl_gateway_latency_seconds", "End-to-end latency", ["endpoint"])
RECORD_FAILURES = Counter("liverl_gateway_record_failures_total", "Trajectories not recorded")
logger = setup_logging("gateway")


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


class ChatRequest(CompletionRequest):
    prompt: None = Field(None, exclude=True)
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


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
    return choice


def choice_logprobs(choice: dict[str, Any], chat: bool) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    if chat:
        return [c["logprob"] for c in logprobs.get("content") or []]
    return [lp for lp in logprobs.get("token_logprobs") or [] if lp is not None]


class Choice:
    """One choice's tokens, gathered from a response or from stream chunks."""

    def __init__(self, completion_id: str) -> None:
        self.completion_id = completion_id
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_token_ids: list[int] = []
        self.routed_experts: Any = None
        self.finish_reason: str | None = None


class Accumulator:
    """Every choice of one request, each recorded as its own completion: choice 0 takes
    the request's completion id, choice i > 0 one of its own."""

    def __init__(self, completion_id: str) -> None:
        self.completion_id = completion_id
        self.prompt_token_ids: list[int] = []
        self.choices: dict[int, Choice] = {}

    def choice(self, index: int) -> Choice:
        if index not in self.choices:
            self.choices[index] = Choice(self.completion_id if index == 0 else new_id("cmpl"))
        return self.choices[index]

    def add(self, payload: dict[str, Any], chat: bool) -> None:
        if payload.get("prompt_token_ids"):
            self.prompt_token_ids = payload["prompt_token_ids"]
        for raw in payload.get("choices") or []:
            choice = self.choice(int(raw.get("index") or 0))
            raw["completion_id"] = choice.completion_id  # the client learns each choice's id
            if raw.get("prompt_token_ids"):
                choice.prompt_token_ids = raw["prompt_token_ids"]
            piece = (raw.get("message") or raw.get("delta") or {}).get("content") if chat else raw.get("text")
            choice.text.append(piece or "")
            choice.token_ids.extend(raw.get("token_ids") or [])
            choice.logprobs.extend(choice_logprobs(raw, chat))
            choice.routed_experts = raw.get("routed_experts", choice.routed_experts)
            choice.finish_reason = raw.get("finish_reason") or choice.finish_reason


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


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.producer = make_producer(settings)
        await app.state.producer.start()
        for replica in router.pool().replicas:  # made now, not by the first request each one answers
            client_for(replica)
        yield
        await asyncio.gather(*recording)
        await asyncio.gather(*(client.aclose() for client in clients.values()))
        await app.state.producer.stop()

    async def health() -> dict:
        pool = router.pool()
        return {"ok": any(r.enabled for r in pool.replicas),
                "replicas": [dict(r.model_dump(include={"name", "policy_version", "enabled"}),
                                  inflight=router.inflight[r.name]) for r in pool.replicas]}

    app = service_app("liverl gateway", settings, health, lifespan)
    limiter = TenantRateLimiter(settings.serving.tenant_requests_per_s, settings.serving.tenant_requests_burst)
    router = Router(settings)
    recording: set[asyncio.Task] = set()
    clients: dict[str, httpx.AsyncClient] = {}  # one per replica address (a socket is a transport)

    def client_for(replica: Replica) -> httpx.AsyncClient:
        if replica.url not in clients:
            clients[replica.url] = replica_async_client(replica.url, settings.serving.request_timeout_s)
        return clients[replica.url]

    def in_background(coroutine) -> None:
        """Record after answering, and survive the client hanging up mid-stream."""
        task = asyncio.create_task(coroutine)
        recording.add(task)
        task.add_done_callback(settled)

    def settled(task: asyncio.Task) -> None:
        recording.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            RECORD_FAILURES.inc()  # a recording that failed in a way nobody foresaw is still counted
            log(logger, "recording failed", error=repr(error))

    async def record(event: Trajectory | RequestRecord, topic: str, key: str) -> None:
        try:
            await asyncio.wait_for(
                await app.state.producer.send(topic, encode(event), key=key.encode()), 10
            )
        except Exception as error:  # serving never fails because analytics is down
            RECORD_FAILURES.inc()
            log(logger, "could not record", topic=topic, error=repr(error))

    async def finish(
        endpoint: str, key: KeyRecord, asked: CompletionRequest, replica: Replica, acc: Accumulator,
        started: float, first_token: float | None, chat: bool, group_id: str | None,
    ) -> None:
        """Record each choice as a trajectory, and the request. A choice that cannot be
        recorded is counted and named in the request's row, never silently lost."""
        latency = (time.perf_counter() - started) * 1000
        router.tokens_answered(sum(len(choice.token_ids or ()) for choice in acc.choices.values()))
        prompt_text = json.dumps(asked.messages) if chat else str(asked.prompt)
        # Choices sampled together for one prompt form a group unless the client named one.
        group_id = group_id or (acc.completion_id if len(acc.choices) > 1 else None)
        failed = []
        for choice in acc.choices.values():
            try:
                trajectory = Trajectory(
                    event_id=choice.completion_id, tenant=key.tenant, completion_id=choice.completion_id,
                    group_id=group_id, policy_version=replica.policy_version, replica=replica.name,
                    prompt_text=prompt_text, completion_text="".join(choice.text),
                    prompt_token_ids=choice.prompt_token_ids or acc.prompt_token_ids,
                    completion_token_ids=choice.token_ids, completion_logprobs=choice.logprobs,
                    routed_experts=choice.routed_experts,
                    sampling=SamplingParams(
                        temperature=1.0 if asked.temperature is None else asked.temperature,
                        top_p=1.0 if asked.top_p is None else asked.top_p,
                        max_tokens=asked.max_tokens, seed=asked.seed,
                    ),
                    finish_reason=choice.finish_reason, latency_ms=latency,
                    time_to_first_token_ms=None if first_token is None else (first_token - started) * 1000,
                )
            except ValidationError as error:
                RECORD_FAILURES.inc()
                failed.append(f"{choice.completion_id}: {error.errors()[0]['msg']}")
                continue
            await record(trajectory, Topics.TRAJECTORIES, choice.completion_id)
        error = f"not recorded: {'; '.join(failed)}"[:500] if failed else None
        await record_request(endpoint, key, 200, latency, replica, acc.completion_id, asked.stream, error)

    async def record_request(
        endpoint: str, key: KeyRecord, status: int, latency: float, replica: Replica | None,
        completion_id: str | None, stream: bool, error: str | None = None,
    ) -> None:
        version = replica.policy_version if replica else None
        REQUESTS.labels(endpoint, str(status), version or "none").inc()
        LATENCY.labels(endpoint).observe(latency / 1000)
        await record(RequestRecord(
            event_id=new_id("req"), tenant=key.tenant, completion_id=completion_id,
            policy_version=version, replica=replica.name if replica else None,
            endpoint=endpoint, status=status, error=error, latency_ms=latency, stream=stream,
        ), Topics.REQUESTS, completion_id or key.tenant)

    async def complete(request: Request, key: KeyRecord, endpoint: str, chat: bool):
        started = time.perf_counter()
        stream = False

        async def refused(status: int, message: str, **kwargs) -> JSONResponse:
            await record_request(endpoint, key, status, (time.perf_counter() - started) * 1000,
                                 None, None, stream, message[:500])
            return refuse(status, message, **kwargs)

        if wait := limiter.take(key.tenant):
            return await refused(429, f"tenant {key.tenant!r} is over its rate limit; retry later",
                                 kind="rate_limit_error", headers={"Retry-After": str(max(1, int(wait + 0.999)))})
        try:
            body = read_json(await request.body())
        except MalformedJSON as error:
            return await refused(400, error.detail)
        if not isinstance(body, dict):
            return await refused(400, "the body must be a JSON object")
        try:
            asked = (ChatRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as error:
            e = error.errors()[0]
            return await refused(400, f"{'.'.join(map(str, e['loc']))}: {e['msg']}")
        stream = asked.stream
        # Completions sampled for one prompt (rollout groups) share this header.
        group_id = request.headers.get("x-liverl-group-id")
        if group_id is not None:
            try:
                GROUP_ID.validate_python(group_id)
            except ValidationError as error:
                return await refused(400, f"x-liverl-group-id: {error.errors()[0]['msg']}")
        alias = request.headers.get("x-liverl-alias")  # a team's name for a version: only that version answers
        if alias is not None:
            try:
                ALIAS.validate_python(alias)
            except ValidationError as error:
                return await refused(400, f"x-liverl-alias: {error.errors()[0]['msg']}")
        try:
            session = request.headers.get("x-liverl-session") or body.get("user")
            replica = await router.pick(str(session) if session is not None else None, alias)
        except NoReplica as error:
            return await refused(503, str(error), kind="service_unavailable")
        except Unroutable as error:
            return await refused(error.status, str(error))
        completion_id = new_id("cmpl")
        http = client_for(replica)
        path = f"/v1/{'chat/completions' if chat else 'completions'}"
        headers = {"x-liverl-policy-version": replica.policy_version, "x-liverl-completion-id": completion_id,
                   "x-liverl-replica": replica.name}
        forwarded = http.build_request("POST", path, json=upstream_body(body, chat))
        router.inflight[replica.name] += 1
        released = False

        def release() -> None:  # exactly once, whatever path the request takes
            nonlocal released
            if not released:
                released = True
                router.inflight[replica.name] -= 1

        try:
            upstream = await http.send(forwarded, stream=True)
        except httpx.HTTPError as error:
            release()
            latency = (time.perf_counter() - started) * 1000
            await record_request(endpoint, key, 502, latency, replica, None, stream, repr(error))
            return refuse(502, f"replica {replica.name} failed: {error!r}", "upstream_error")
        except BaseException:
            release()
            raise
        if upstream.status_code != 200:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                release()
            latency = (time.perf_counter() - started) * 1000
            await record_request(endpoint, key, upstream.status_code, latency, replica, None, stream,
                                 content.decode(errors="replace")[:500])
            return upstream_error(upstream.status_code, content, headers)

        acc = Accumulator(completion_id)
        if not stream:
            try:
                payload = json.loads(await upstream.aread())
                acc.add(payload, chat)
            except (ValueError, TypeError, AttributeError) as error:
                await record_request(endpoint, key, 502, (time.perf_counter() - started) * 1000, replica,
                                     None, stream, f"unreadable replica answer: {error!r}"[:500])
                return refuse(502, f"replica {replica.name} answered something unreadable", "upstream_error")
            finally:
                await upstream.aclose()
                release()
            payload["id"] = completion_id
            payload["completion_id"] = completion_id
            payload["model"] = body.get("model", SERVED_MODEL_NAME)
            payload["choices"] = [client_view(c, body, chat) for c in payload.get("choices", [])]
            payload.pop("prompt_token_ids", None)
            in_background(finish(endpoint, key, asked, replica, acc, started, None, chat, group_id))
            return JSONResponse(payload, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            first_token = None
            try:
                async for line in upstream.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    acc.add(chunk, chat)
                    first_token = first_token or time.perf_counter()
                    if not chunk.get("choices") and not body.get("stream_options"):
                        continue  # the usage chunk we asked for, the client did not
                    chunk.update(id=completion_id, completion_id=completion_id,
                                 model=body.get("model", SERVED_MODEL_NAME))
                    chunk["choices"] = [client_view(c, body, chat) for c in chunk.get("choices", [])]
                    chunk.pop("prompt_token_ids", None)
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                await upstream.aclose()
                release()
                in_background(finish(endpoint, key, asked, replica, acc, started, first_token, chat, group_id))

        return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions", openapi_extra=request_schema(CompletionRequest))
    async def completions(request: Request, key: KeyRecord = Depends(require_key)):
        return await complete(request, key, "completions", chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_schema(ChatRequest))
    async def chat_completions(request: Request, key: KeyRecord = Depends(require_key)):
        return await complete(request, key, "chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(key: KeyRecord = Depends(require_key)) -> dict:
        versions = sorted({r.policy_version for r in router.pool().replicas})
        return {"object": "list", "data": [
            {"id": SERVED_MODEL_NAME, "object": "model", "owned_by": "liverl", "versions": versions}
        ]}

    @app.get("/admin/load")
    async def load(key: KeyRecord = Depends(require_admin)) -> GatewayLoad:
        """Production requests in flight per replica, waiting, routed per second, tokens per second."""
        return router.load()

    return app


if __name__ == "__main__":
    from liverl.process import serve

    settings = get_settings()
    serve(create_app(settings), settings.host, settings.ports.gateway)
