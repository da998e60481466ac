"""What the gateway records on Kafka: every choice it served as a trajectory, every
request (served or refused) as a request record.

Recording runs after the answer, in the background: a client never waits on the broker,
hanging up mid-stream loses nothing, and serving never fails because analytics is down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from liverl.contracts import RequestRecord, SamplingParams, Topics, Trajectory, new_id
from liverl.kafka import encode, make_producer
from liverl.keys import KeyRecord
from liverl.observability import log, setup_logging
from liverl.pool import Replica
from liverl.settings import Settings

REQUESTS = Counter("liverl_gateway_requests_total", "Requests", ["endpoint", "status", "version"])
LATENCY = Histogram("liverl_gateway_latency_seconds", "End-to-end latency", ["endpoint"])
RECORD_FAILURES = Counter("liverl_gateway_record_failures_total", "Trajectories not recorded")
logger = setup_logging("gateway")


class Asked(Protocol):
    """What a trajectory keeps of the request that asked for it."""

    stream: bool

    def prompt_text(self) -> str: ...

    def sampling(self) -> SamplingParams: ...


@dataclass
class Exchange:
    """One request as its records tell it, filled in as the gateway learns more."""

    endpoint: str
    caller: KeyRecord
    started: float = field(default_factory=time.perf_counter)
    asked: Asked | None = None
    group_id: str | None = None  # completions sampled for one prompt share it
    replica: Replica | None = None

    @property
    def stream(self) -> bool:
        return self.asked is not None and self.asked.stream

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000


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

    def tokens(self) -> int:
        return sum(len(choice.token_ids or ()) for choice in self.choices.values())


class Recorder:
    """The gateway's Kafka producer and the recordings it has under way."""

    producer: AIOKafkaProducer  # made by start(), as the app starts

    def __init__(self, settings: Settings):
        self.settings = settings
        self.under_way: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.producer = make_producer(self.settings)
        await self.producer.start()

    async def stop(self) -> None:
        """Once every recording under way is sent."""
        await asyncio.gather(*self.under_way)
        await self.producer.stop()

    def later(self, recording: Coroutine) -> None:
        """Record after answering, and survive the client hanging up mid-stream."""
        task = asyncio.create_task(recording)
        self.under_way.add(task)
        task.add_done_callback(self.settled)

    def settled(self, task: asyncio.Task) -> None:
        self.under_way.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            RECORD_FAILURES.inc()  # a recording that failed in a way nobody foresaw is still counted
            log(logger, "recording failed", error=repr(error))

    async def send(self, event: Trajectory | RequestRecord, topic: str, partition_key: str) -> None:
        try:
            await asyncio.wait_for(
                await self.producer.send(topic, encode(event), key=partition_key.encode()), 10
            )
        except Exception as error:  # serving never fails because analytics is down
            RECORD_FAILURES.inc()
            log(logger, "could not record", topic=topic, error=repr(error))

    async def completion(self, exchange: Exchange, gathered: Accumulator, first_token: float | None) -> None:
        """Each choice as a trajectory, and the request. A choice that cannot be recorded
        is counted and named in the request's row, never silently lost."""
        asked, replica = exchange.asked, exchange.replica
        assert asked is not None and replica is not None  # served: it was validated and routed
        latency = exchange.elapsed_ms()
        # Choices sampled together for one prompt form a group unless the client named one.
        group_id = exchange.group_id or (gathered.completion_id if len(gathered.choices) > 1 else None)
        prompt_text = asked.prompt_text()
        failed = []
        for choice in gathered.choices.values():
            try:
                trajectory = Trajectory(
                    event_id=choice.completion_id, tenant=exchange.caller.tenant, completion_id=choice.completion_id,
                    group_id=group_id, policy_version=replica.policy_version, replica=replica.name,
                    prompt_text=prompt_text, completion_text="".join(choice.text),
                    prompt_token_ids=choice.prompt_token_ids or gathered.prompt_token_ids,
                    completion_token_ids=choice.token_ids, completion_logprobs=choice.logprobs,
                    routed_experts=choice.routed_experts, sampling=asked.sampling(),
                    finish_reason=choice.finish_reason, latency_ms=latency,
                    time_to_first_token_ms=None if first_token is None else (first_token - exchange.started) * 1000,
                )
            except ValidationError as error:
                RECORD_FAILURES.inc()
                failed.append(f"{choice.completion_id}: {error.errors()[0]['msg']}")
                continue
            await self.send(trajectory, Topics.TRAJECTORIES, choice.completion_id)
        not_recorded = f"not recorded: {'; '.join(failed)}"[:500] if failed else None
        await self.request(exchange, 200, gathered.completion_id, not_recorded, latency)

    async def request(self, exchange: Exchange, status: int, completion_id: str | None = None,
                      error: str | None = None, latency: float | None = None) -> None:
        """The request's row (and its metrics): by the time it was answered unless `latency` says."""
        latency = exchange.elapsed_ms() if latency is None else latency
        replica = exchange.replica
        version = replica.policy_version if replica else None
        REQUESTS.labels(exchange.endpoint, str(status), version or "none").inc()
        LATENCY.labels(exchange.endpoint).observe(latency / 1000)
        await self.send(RequestRecord(
            event_id=new_id("req"), tenant=exchange.caller.tenant, completion_id=completion_id,
            policy_version=version, replica=replica.name if replica else None,
            endpoint=exchange.endpoint, status=status, error=error, latency_ms=latency, stream=exchange.stream,
        ), Topics.REQUESTS, completion_id or exchange.caller.tenant)
