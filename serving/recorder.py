"""What the gateway records on Kafka: every choice it served as a trajectory, every
request (served or refused) as a request record.

Recording costs the serving loop a few microseconds a record: each is built and handed to
librdkafka (confluent-kafka), which batches, sends and retries on its own threads, and
the loop reads its delivery reports a few times a second. A client never waits on the
broker, hanging up mid-stream loses nothing (the record is handed over before the
connection is closed), and serving never fails because recording did. A record the
broker does not take goes to the outbox (serving/outbox.py) and is re-published from it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol

from confluent_kafka import KafkaException, Message, Producer
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError

from liverl.contracts import RequestRecord, SamplingParams, Topics, Trajectory, new_id
from liverl.kafka import encode
from liverl.keys import KeyRecord
from liverl.observability import log, setup_logging
from liverl.pool import Replica
from liverl.settings import Settings
from serving.outbox import Outbox
from serving.republisher import Republisher

REQUESTS = Counter("liverl_gateway_requests_total", "Requests", ["endpoint", "status", "version"])
LATENCY = Histogram("liverl_gateway_latency_seconds", "End-to-end latency", ["endpoint"])
RECORD_FAILURES = Counter("liverl_gateway_record_failures_total", "Records lost: not built, or not taken by the "
                          "broker and not kept by the outbox")
logger = setup_logging("gateway")
DELIVERY_TIMEOUT_S = 10.0  # a record the broker has not acknowledged by then goes to the outbox
DELIVERY_REPORTS_EVERY_S = 0.1  # nothing waits on a report but the count of what was not recorded
P = ParamSpec("P")


def unfailing(record: Callable[P, None]) -> Callable[P, None]:
    """Serving never fails because recording did: what a recording raises that nobody
    foresaw is counted and logged, not raised into the request."""

    @functools.wraps(record)
    def recording(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            record(*args, **kwargs)
        except Exception as error:
            RECORD_FAILURES.inc()
            log(logger, "recording failed", error=repr(error))

    return recording


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
    """The gateway's Kafka producer: each record handed to librdkafka as it is made."""

    producer: Producer  # these three made by start(), as the app starts
    outbox: Outbox
    republisher: Republisher

    def __init__(self, settings: Settings):
        self.settings = settings
        self.reports: asyncio.Task | None = None

    async def start(self) -> None:
        config = {
            "bootstrap.servers": self.settings.bootstrap, "acks": "all",
            # Java's and aiokafka's partitioner, as the ingest API's: feedback lands on the
            # partition of its trajectory, and the join relies on it.
            "partitioner": "murmur2_random",
            "linger.ms": 5, "message.max.bytes": 4 * 1024 * 1024,
            "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000),
            "logger": logging.getLogger("librdkafka"),
        }
        self.outbox = Outbox(self.settings.data_dir / "outbox" / "gateway", self.settings.serving.outbox_bytes)
        self.producer = Producer(dict(config, on_delivery=self.delivered,
                                      **{"delivery.report.only.error": True}))  # no call per record delivered
        self.republisher = Republisher(self.outbox, Producer(config))  # what an earlier run left included
        self.republisher.start()
        self.reports = asyncio.create_task(self.serve_delivery_reports())

    async def stop(self) -> None:
        """Once every record handed over is delivered, kept in the outbox, or counted as lost."""
        if self.reports:
            self.reports.cancel()
        await self.republisher.stop()
        self.producer.flush(DELIVERY_TIMEOUT_S + 5)  # serves the last reports, failures included
        self.outbox.close()

    async def serve_delivery_reports(self) -> None:
        while True:
            self.producer.poll(0)
            await asyncio.sleep(DELIVERY_REPORTS_EVERY_S)

    def hand_over(self, topic: str, key: str, event: BaseModel) -> None:
        """The one place a record leaves the gateway: to the producer, or, if it cannot
        take it (its queue full while the broker is away), to `not_delivered`."""
        value = encode(event)
        try:
            self.producer.produce(topic, value, key.encode())
        except (BufferError, KafkaException) as error:
            self.not_delivered(topic, key.encode(), value, repr(error))

    def delivered(self, error: object, message: Message) -> None:
        if error is not None:  # only errors are reported
            self.not_delivered(message.topic(), message.key(), message.value(), str(error))

    def not_delivered(self, topic: str | None, key: bytes | None, value: bytes | None, why: str) -> None:
        """A record the broker did not take: kept in the outbox to be re-published, or, past
        its bound, counted as lost."""
        log(logger, "the broker did not take a record", topic=topic, error=why)
        if topic is None or value is None or not self.outbox.put(topic, key, value):
            RECORD_FAILURES.inc()

    @unfailing
    def completion(self, exchange: Exchange, gathered: Accumulator, first_token: float | None) -> None:
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
            self.hand_over(Topics.TRAJECTORIES, choice.completion_id, trajectory)
        not_recorded = f"not recorded: {'; '.join(failed)}"[:500] if failed else None
        self.request(exchange, 200, gathered.completion_id, not_recorded, latency)

    @unfailing
    def request(self, exchange: Exchange, status: int, completion_id: str | None = None,
                error: str | None = None, latency: float | None = None) -> None:
        """The request's row (and its metrics): by the time it was answered unless `latency` says."""
        latency = exchange.elapsed_ms() if latency is None else latency
        replica = exchange.replica
        version = replica.policy_version if replica else None
        REQUESTS.labels(exchange.endpoint, str(status), version or "none").inc()
        LATENCY.labels(exchange.endpoint).observe(latency / 1000)
        self.hand_over(Topics.REQUESTS, completion_id or exchange.caller.tenant, RequestRecord(
            event_id=new_id("req"), tenant=exchange.caller.tenant, completion_id=completion_id,
            policy_version=version, replica=replica.name if replica else None,
            endpoint=exchange.endpoint, status=status, error=error, latency_ms=latency, stream=exchange.stream,
        ))
