"""Rollout worker: GRPO groups sampled on replicas lent to rollouts, scored, published.

For each replica the pool lends to rollouts (alias `rollout`, which general traffic never
reaches), the worker keeps `groups_in_flight` groups going (so the replica samples one
while another is scored). For a group it draws a task from the environment,
asks the replica for G completions of it in one request (so one version, the replica's),
scores each in the sandbox, and publishes the G trajectories (source `rollout`, one group
id, `group_size` G, behaviour logprobs) to the trajectories topic, as the gateway does,
and each score as a `rollout_score` outcome on the feedback topic; the stream joins them
and the learner trains the group whole. A request cut by a take-back (the replica's
requests are aborted) publishes nothing: the group is counted as cut, never half-scored.
With `capacity.refresh = between_groups` it starts no group on a replica behind the
learner's newest version: the capacity scheduler moves the replica once its last group
ends, so each version's groups are sampled from its parent.
"""

from __future__ import annotations

import asyncio
import functools
import random
import signal
from collections import Counter as Tally
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from aiokafka import AIOKafkaProducer
from fastapi import FastAPI
from prometheus_client import Counter

from liverl.contracts import (
    ROLLOUT_SCORE,
    FeedbackEvent,
    OutcomeBody,
    SamplingParams,
    Topics,
    Trajectory,
    new_id,
    utcnow,
)
from liverl.http import service_app
from liverl.kafka import encode, make_producer
from liverl.observability import log, setup_logging
from liverl.pool import SERVED_MODEL_NAME, Replica, read_pool, replica_async_client
from liverl.settings import Settings, get_settings
from policies.registry import Registry
from rollouts.environment import Environment, MultiTurnEnvironment, Task, configured_environment
from rollouts.episode import Cut, Misconfigured, frame, play

GROUPS = Counter("liverl_rollout_groups_total", "Rollout groups: published whole, cut (never published) "
                 "or failed", ["outcome"])
COMPLETIONS = Counter("liverl_rollout_completions_total", "Rollout completions published")
logger = setup_logging("rollouts")


@dataclass
class Attempt:
    """One member of a group: the text its environment scores, and what its trajectory records."""

    text: str
    recorded: dict[str, Any]  # Trajectory fields: token ids and logprobs, or the turns
    tokens: int  # tokens the policy wrote


def lent_replicas(settings: Settings) -> list[Replica]:
    """Replicas lent to rollouts and not being taken back (disabled first, then aborted)."""
    return [r for r in read_pool(settings).lent if r.enabled]


class RolloutWorker:
    def __init__(self, settings: Settings, environment: Environment | None = None, seed: int | None = None):
        self.settings, self.config = settings, settings.rollouts
        self.environment = environment or configured_environment(self.config)
        # A multi-turn episode's context: the replicas' window unless set shorter.
        self.context_tokens = self.config.context_tokens or settings.serving.max_model_len
        if self.context_tokens > settings.serving.max_model_len:
            raise ValueError(f"rollouts.context_tokens={self.context_tokens} is more than the replicas' "
                             f"serving.max_model_len={settings.serving.max_model_len}")
        self.tasks = self.environment.tasks("train", random.Random(seed))
        self.scoring = ThreadPoolExecutor(self.config.scoring_threads)  # the sandbox waits in poll
        self.counts: Tally[str] = Tally()  # groups, cut, completions, tokens
        self.misconfigured: str | None = None  # set once no group can succeed with these settings

    def request(self, task: Task) -> dict[str, Any]:
        """One request for the whole group: G samples of the task at the rollout temperature."""
        return {"model": SERVED_MODEL_NAME, "prompt": task.prompt, "n": self.config.group_size,
                "max_tokens": self.config.max_tokens, "temperature": self.config.temperature,
                "logprobs": 0, "return_token_ids": True, "stop": list(task.stop) or None}

    @functools.cached_property
    def registry(self) -> Registry:
        return Registry(self.settings.policies_dir)

    def behind_the_learner(self, replica: Replica) -> bool:
        """With `capacity.refresh = between_groups`: the learner has a version newer than the
        one `replica` serves, so no group starts there until the scheduler moves it."""
        return (self.settings.capacity.refresh == "between_groups"
                and self.registry.rollout_version().version != replica.policy_version)

    def still_lent(self, replica: Replica) -> bool:
        """`replica` is still lent to rollouts, enabled, on the version the group started on."""
        now = next((r for r in lent_replicas(self.settings) if r.name == replica.name), None)
        return now is not None and now.policy_version == replica.policy_version

    async def attempts(self, client: httpx.AsyncClient, task: Task, replica: Replica) -> list[Attempt] | None:
        """The group's G attempts at `task`, or None if any did not complete (taken back, aborted)."""
        if not isinstance(self.environment, MultiTurnEnvironment):
            return await self.sample(client, task)
        try:
            pieces = await frame(client, self.environment, task, self.config, self.context_tokens)
        except Cut:
            return None
        try:
            async with asyncio.TaskGroup() as group:  # one episode cut cancels the others
                running = [group.create_task(play(client, self.environment, task, pieces, self.config,
                                                  self.context_tokens, lambda: self.still_lent(replica), self.scoring))
                           for _ in range(self.config.group_size)]
        except ExceptionGroup as errors:
            if (other := next((e for e in errors.exceptions if not isinstance(e, Cut)), None)) is not None:
                raise other from None  # misconfigured, or a broken environment
            return None
        episodes = [r.result() for r in running]
        self.counts["summaries"] += sum(e.summaries for e in episodes)
        return [Attempt(e.final, {"turns": e.turns}, e.written_tokens) for e in episodes]

    async def sample(self, client: httpx.AsyncClient, task: Task) -> list[Attempt] | None:
        """The group's completions in one request, or None if it did not complete."""
        try:
            response = await client.post("/v1/completions", json=self.request(task))
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        answer = response.json()
        choices = answer.get("choices") or []
        if len(choices) != self.config.group_size or any(c.get("finish_reason") == "abort" for c in choices):
            return None
        return [Attempt(c.get("text") or "", {
            "prompt_token_ids": c.get("prompt_token_ids") or answer.get("prompt_token_ids") or [],
            "completion_token_ids": c.get("token_ids") or [],
            "completion_logprobs": [lp for lp in (c.get("logprobs") or {}).get("token_logprobs") or []
                                    if lp is not None],
            "routed_experts": c.get("routed_experts"), "finish_reason": c.get("finish_reason")},
            len(c.get("token_ids") or [])) for c in choices]

    async def score(self, task: Task, attempts: list[Attempt]) -> list[float]:
        """Each attempt's score; attempts the environment would score alike (`scored_as`) are
        scored once: about 30% of a coding group repeat another member's program, and a
        sandbox run is most of the CPU a rollout costs (docs/benchmarks.md, "Harvest")."""
        loop = asyncio.get_running_loop()
        keys = [object() if (key := self.environment.scored_as(task, a.text)) is None else key for a in attempts]
        runs: dict[Any, str] = {}
        for key, attempt in zip(keys, attempts, strict=True):
            runs.setdefault(key, attempt.text)
        scores = await asyncio.gather(*(
            loop.run_in_executor(self.scoring, self.environment.score, task, text) for text in runs.values()))
        by_key = dict(zip(runs, scores, strict=True))
        return [by_key[key] for key in keys]

    def records(self, task: Task, replica: Replica, attempts: list[Attempt],
                scores: list[float]) -> list[tuple[str, str, Trajectory | FeedbackEvent]]:
        """(topic, key, event) for each attempt's trajectory and its score."""
        group_id, tenant = new_id("grp"), self.config.tenant
        out: list[tuple[str, str, Trajectory | FeedbackEvent]] = []
        for attempt, score in zip(attempts, scores, strict=True):
            completion_id = new_id("roll")
            out.append((Topics.TRAJECTORIES, completion_id, Trajectory(
                event_id=completion_id, tenant=tenant, completion_id=completion_id, group_id=group_id,
                group_size=len(attempts), policy_version=replica.policy_version, replica=replica.name,
                source="rollout", prompt_text=task.prompt, completion_text=attempt.text,
                sampling=SamplingParams(temperature=self.config.temperature, max_tokens=self.config.max_tokens),
                **attempt.recorded)))
            out.append((Topics.FEEDBACK, completion_id, FeedbackEvent(
                event_id=new_id("score"), tenant=tenant, timestamp=utcnow(),
                body=OutcomeBody(completion_id=completion_id, name=ROLLOUT_SCORE, value=score))))
        return out

    async def run_group(self, producer: AIOKafkaProducer, client: httpx.AsyncClient,
                        replica: Replica) -> list[Trajectory] | None:
        """One task's group on `replica`, published whole: its trajectories, or None if it was cut."""
        task = next(self.tasks)
        attempts = await self.attempts(client, task, replica)
        if attempts is None:
            self.counts["cut"] += 1
            GROUPS.labels("cut").inc()
            return None
        scores = await self.score(task, attempts)
        records = self.records(task, replica, attempts, scores)
        # Each keyed by its completion, trajectory first: the stream joins them on one partition.
        sent = [await producer.send(topic, encode(event), key=key.encode()) for topic, key, event in records]
        await asyncio.gather(*sent)
        self.counts.update(groups=1, completions=len(attempts), tokens=sum(a.tokens for a in attempts))
        GROUPS.labels("published").inc()
        COMPLETIONS.inc(len(attempts))
        return [event for _, _, event in records if isinstance(event, Trajectory)]

    async def run(self, producer: AIOKafkaProducer, stop: asyncio.Event) -> None:
        """`groups_in_flight` groups at a time on each lent replica, until stopped."""
        clients: dict[str, httpx.AsyncClient] = {}
        running: dict[str, list[asyncio.Task]] = {}
        try:
            while not stop.is_set():
                for replica in [] if self.misconfigured else lent_replicas(self.settings):
                    active = [t for t in running.get(replica.name, []) if not t.done()]
                    for ended in (t for t in running.get(replica.name, []) if t.done()):
                        await self.ended(replica, ended)
                    if self.misconfigured:
                        break
                    client = clients.setdefault(replica.url, replica_async_client(
                        replica.url, self.settings.serving.request_timeout_s))
                    wanted = 0 if self.behind_the_learner(replica) else self.config.groups_in_flight - len(active)
                    running[replica.name] = active + [
                        asyncio.create_task(self.run_group(producer, client, replica)) for _ in range(wanted)]
                await asyncio.sleep(0.1)
        finally:
            await asyncio.gather(*(t for tasks in running.values() for t in tasks), return_exceptions=True)
            await asyncio.gather(*(c.aclose() for c in clients.values()))

    async def ended(self, replica: Replica, group: asyncio.Task) -> None:
        """A finished group's error, if any: misconfigured stops rollouts (shown by /health),
        anything else (the broker, the sandbox) is counted and slows the next one down."""
        if isinstance(error := group.exception(), Misconfigured):
            self.misconfigured = str(error)
            log(logger, "rollouts stopped: misconfigured", error=self.misconfigured)
        elif error is not None:
            GROUPS.labels("failed").inc()
            log(logger, "rollout group failed", replica=replica.name, error=repr(error))
            await asyncio.sleep(1.0)  # not a tight loop while it lasts


def create_app(worker: RolloutWorker) -> FastAPI:
    settings = worker.settings

    def health() -> dict:
        return {"ok": worker.misconfigured is None, "error": worker.misconfigured,
                "lent": [r.name for r in lent_replicas(settings)], **worker.counts}

    return service_app("liverl rollout worker", settings, health)


async def main(settings: Settings) -> None:
    """The worker process: /health and /metrics, and groups on every lent replica."""
    worker = RolloutWorker(settings)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    server = uvicorn.Server(uvicorn.Config(create_app(worker), host=settings.host, port=settings.ports.rollouts,
                                           log_level="warning"))
    producer = make_producer(settings)
    await producer.start()
    try:
        await asyncio.gather(server.serve(), worker.run(producer, stop), stop_server(server, stop))
    finally:
        await producer.stop()


async def stop_server(server: uvicorn.Server, stop: asyncio.Event) -> None:
    await stop.wait()
    server.should_exit = True


if __name__ == "__main__":
    asyncio.run(main(get_settings()))
