"""The OpenAI-compatible serving gateway in front of the vLLM replicas.

It asks each replica for what training needs (prompt and completion token ids, the
sampled tokens' logprobs, routed experts where the engine has them), answers the
client in plain OpenAI shape plus `completion_id`, and records every completion as a
trajectory and every request (served or failed) as a request record on Kafka.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter as Tally
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter, Histogram

from liverl.contracts import RequestRecord, SamplingParams, Topics, Trajectory, new_id
from liverl.kafka import encode, make_producer
from liverl.keys import KeyRecord, KeyStore, require_key
from liverl.observability import log, mount_metrics, setup_logging
from liverl.settings import Settings, get_settings
from serving.replicas import SERVED_MODEL_NAME, Pool, Replica, pool_file, read_pool

REQUESTS = Counter("liverl_gateway_requests_total", "Requests", ["endpoint", "status", "version"])
LATENCY = Histogram("liverl_gateway_latency_seconds", "End-to-end latency", ["endpoint"])
RECORD_FAILURES = Counter("liverl_gateway_record_failures_total", "Trajectories not recorded")
logger = setup_logging("gateway")


class NoReplica(Exception):
    pass


class Router:
    """Least-in-flight routing over the enabled replicas of the pool file."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.inflight: Tally[str] = Tally()
        self._pool = Pool()
        self._mtime: int | None = None

    def pool(self) -> Pool:
        try:
            mtime = pool_file(self.settings).stat().st_mtime_ns
        except FileNotFoundError:
            return self._pool
        if mtime != self._mtime:
            self._pool, self._mtime = read_pool(self.settings), mtime
        return self._pool

    async def pick(self) -> Replica:
        """The least busy enabled replica; while a swap has none enabled, wait for one."""
        deadline = time.monotonic() + self.settings.serving.no_replica_wait_s
        while True:
            enabled = [r for r in self.pool().replicas if r.enabled]
            if enabled:
                return min(enabled, key=lambda r: self.inflight[r.name])
            if time.monotonic() > deadline:
                raise NoReplica("no replica is serving")
            await asyncio.sleep(0.02)


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


class Accumulator:
    """Gathers one choice's tokens from a response or from stream chunks."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_token_ids: list[int] = []
        self.routed_experts: Any = None
        self.finish_reason: str | None = None

    def add(self, payload: dict[str, Any], chat: bool) -> None:
        if payload.get("prompt_token_ids"):
            self.prompt_token_ids = payload["prompt_token_ids"]
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids"):
                self.prompt_token_ids = choice["prompt_token_ids"]
            piece = (choice.get("message") or choice.get("delta") or {}).get("content") if chat else choice.get("text")
            self.text.append(piece or "")
            self.token_ids.extend(choice.get("token_ids") or [])
            self.logprobs.extend(choice_logprobs(choice, chat))
            self.routed_experts = choice.get("routed_experts", self.routed_experts)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.producer = make_producer(settings)
        await app.state.producer.start()
        app.state.http = httpx.AsyncClient(timeout=settings.serving.request_timeout_s)
        yield
        await asyncio.gather(*recording)
        await app.state.http.aclose()
        await app.state.producer.stop()

    app = FastAPI(title="liverl gateway", lifespan=lifespan)
    app.state.keys = KeyStore(settings.keys_file)
    router = Router(settings)
    recording: set[asyncio.Task] = set()
    mount_metrics(app)

    def in_background(coroutine) -> None:
        """Record after answering, and survive the client hanging up mid-stream."""
        task = asyncio.create_task(coroutine)
        recording.add(task)
        task.add_done_callback(recording.discard)

    async def record(event: Trajectory | RequestRecord, topic: str, key: str) -> None:
        try:
            await asyncio.wait_for(
                await app.state.producer.send(topic, encode(event), key=key.encode()), 10
            )
        except Exception as error:  # serving never fails because analytics is down
            RECORD_FAILURES.inc()
            log(logger, "could not record", topic=topic, error=repr(error))

    async def finish(
        endpoint: str, key: KeyRecord, body: dict, replica: Replica, completion_id: str,
        acc: Accumulator, started: float, first_token: float | None, chat: bool,
        group_id: str | None,
    ) -> None:
        latency = (time.perf_counter() - started) * 1000
        prompt_text = json.dumps(body.get("messages")) if chat else str(body.get("prompt", ""))
        trajectory = Trajectory(
            event_id=completion_id, tenant=key.tenant, completion_id=completion_id,
            group_id=group_id,
            policy_version=replica.policy_version, replica=replica.name,
            prompt_text=prompt_text, completion_text="".join(acc.text),
            prompt_token_ids=acc.prompt_token_ids, completion_token_ids=acc.token_ids,
            completion_logprobs=acc.logprobs, routed_experts=acc.routed_experts,
            sampling=SamplingParams(
                temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                max_tokens=body.get("max_tokens"), seed=body.get("seed"),
            ),
            finish_reason=acc.finish_reason, latency_ms=latency,
            time_to_first_token_ms=None if first_token is None else (first_token - started) * 1000,
        )
        await record(trajectory, Topics.TRAJECTORIES, completion_id)
        await record_request(endpoint, key, 200, latency, replica, completion_id, bool(body.get("stream")))

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

    def error_response(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)

    async def complete(request: Request, key: KeyRecord, endpoint: str, chat: bool):
        started = time.perf_counter()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as error:
            await record_request(endpoint, key, 400, 0.0, None, None, False, str(error))
            return error_response(400, f"malformed JSON: {error}", "invalid_request_error")
        try:
            replica = await router.pick()
        except NoReplica as error:
            await record_request(endpoint, key, 503, 0.0, None, None, False, str(error))
            return error_response(503, str(error), "service_unavailable")
        completion_id = new_id("cmpl")
        # Completions sampled for one prompt (rollout groups) share this header.
        group_id = request.headers.get("x-liverl-group-id")
        url = f"{replica.url}/v1/{'chat/completions' if chat else 'completions'}"
        headers = {"x-liverl-policy-version": replica.policy_version, "x-liverl-completion-id": completion_id}
        router.inflight[replica.name] += 1
        try:
            upstream = await app.state.http.send(
                app.state.http.build_request("POST", url, json=upstream_body(body, chat)), stream=True
            )
        except httpx.HTTPError as error:
            router.inflight[replica.name] -= 1
            latency = (time.perf_counter() - started) * 1000
            await record_request(endpoint, key, 502, latency, replica, None, False, repr(error))
            return error_response(502, f"replica {replica.name} failed: {error!r}", "upstream_error")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            router.inflight[replica.name] -= 1
            latency = (time.perf_counter() - started) * 1000
            await record_request(endpoint, key, upstream.status_code, latency, replica, None,
                                 bool(body.get("stream")), content.decode(errors="replace")[:500])
            return JSONResponse(json.loads(content or b"{}"), upstream.status_code, headers=headers)

        acc = Accumulator()
        if not body.get("stream"):
            try:
                payload = json.loads(await upstream.aread())
            finally:
                await upstream.aclose()
                router.inflight[replica.name] -= 1
            acc.add(payload, chat)
            payload["id"] = completion_id
            payload["completion_id"] = completion_id
            payload["model"] = body.get("model", SERVED_MODEL_NAME)
            payload["choices"] = [client_view(c, body, chat) for c in payload.get("choices", [])]
            payload.pop("prompt_token_ids", None)
            in_background(finish(endpoint, key, body, replica, completion_id, acc, started, None,
                                 chat, group_id))
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
                router.inflight[replica.name] -= 1
                in_background(finish(endpoint, key, body, replica, completion_id, acc, started,
                                     first_token, chat, group_id))

        return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request, key: KeyRecord = Depends(require_key)):
        return await complete(request, key, "completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, key: KeyRecord = Depends(require_key)):
        return await complete(request, key, "chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(key: KeyRecord = Depends(require_key)) -> dict:
        versions = sorted({r.policy_version for r in router.pool().replicas})
        return {"object": "list", "data": [
            {"id": SERVED_MODEL_NAME, "object": "model", "owned_by": "liverl", "versions": versions}
        ]}

    @app.get("/health")
    async def health() -> dict:
        pool = router.pool()
        return {"ok": any(r.enabled for r in pool.replicas),
                "replicas": [dict(r.model_dump(include={"name", "policy_version", "enabled"}),
                                  inflight=router.inflight[r.name]) for r in pool.replicas]}

    return app


if __name__ == "__main__":
    from liverl.process import serve

    settings = get_settings()
    serve(create_app(settings), settings.host, settings.ports.gateway)
