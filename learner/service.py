"""The learner: a consumer-group member on rewarded samples that writes policy versions.

Cycle: consume samples (latest revision of each wins; stale (a version too far behind, or
waiting too long), excluded-tenant, already trained and malformed samples are counted,
never trained) -> when N samples arrived or
T passed, train -> write the candidate version, the trained sample ids and the offsets
in one registry transaction -> commit the Kafka offsets. The promotion controller
(`promotion/controller.py`, its own process) takes candidates from the registry, so
serving never waits for training and training never waits for a canary.

When the controller takes a version off users (a canary aborted, a slide rolled back)
it asks for a rewind in the registry: the learner continues from that stable version's
weights and optimizer state, not from the rejected chain.

A learner killed at any line resumes from the registry: the head version's master
weights and optimizer state (`Registry.head`), and the offsets recorded with it.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import Depends, FastAPI, Query
from kafka import (
    ConsumerRebalanceListener,
    KafkaConsumer,
    OffsetAndMetadata,
    TopicPartition,
)
from prometheus_client import Counter, Gauge
from pydantic import ValidationError

from learner import distributed
from learner.mix import ReplayBuffer, held_step, settled_step
from learner.own_groups import OwnGroups
from learner.skill_check import SkillCheck
from learner.trainer import Trainer, problem
from liverl.contracts import DeadLetter, RewardedSample, Topics
from liverl.faults import crash_point
from liverl.http import Audit, service_app
from liverl.kafka import KAFKA_PYTHON_API_VERSION, encode, produce_sync
from liverl.keys import KeyRecord, require_admin
from liverl.observability import log, setup_logging
from liverl.pool import read_pool
from liverl.process import serve_beside
from liverl.settings import Settings, get_settings
from policies.divergence import kl_between
from policies.offline_eval import Verdict, offline_check, snis, snis_difference
from policies.registry import PolicyVersion, Registry, SampleWindow
from sync.transport import ship

GROUP = "liverl-learner"
DROPPED = Counter("liverl_learner_dropped_total", "Samples not trained on, by reason", ["reason"])
CONSUMED = Counter("liverl_learner_consumed_total", "Samples consumed")
VERSION = Gauge("liverl_learner_version", "Sequence number of the latest version")
PENDING = Gauge("liverl_learner_pending", "Samples waiting for the next version")
logger = setup_logging("learner")


def held_out(sample: RewardedSample, fraction: float) -> bool:
    """A fixed, hash-based share of samples never trains: the offline gate's data. A
    group is kept out or trained whole (its advantages are relative to its members)."""
    key = f"{sample.tenant}:{sample.trajectory.group_id}" if sample.trajectory.group_id else sample.sample_id
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def unserved_chain(version: PolicyVersion, serving: set[str], get: Callable[[str], PolicyVersion],
                   most: int) -> int:
    """How many versions, from `version` back along its parents, no replica serves (the
    chain's lead over what users get), counting at most `most`."""
    count = 0
    while count < most and version.version not in serving:
        count += 1
        if version.parent is None:
            break
        version = get(version.parent)
    return count


def choose_groups(groups: list[OpenGroup], production: int, share: float | None) -> list[OpenGroup]:
    """The complete groups a version takes beside `production` samples: all of them, or,
    with a `share`, whole groups in arrival order while rollouts stay at most that share of
    the version (first in, first out, so no group is passed over for ever; when no
    production sample waits, rollouts train alone)."""
    groups = sorted(groups, key=lambda g: g.opened)
    if share is None or production == 0:
        return groups
    room, chosen = share / (1 - share) * production, []
    for group in groups:
        if group.size > room:
            break
        chosen.append(group)
        room -= group.size
    return chosen


@dataclass
class OpenGroup:
    """The members of a sized group seen so far, and where the first sits in each partition
    (offsets are not committed past them until the group is trained or given up)."""

    size: int
    policy_version: str
    opened: float = field(default_factory=time.time)
    members: dict[str, RewardedSample] = field(default_factory=dict)
    first_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    passed_over: int = 0  # versions written while it was complete and waited (rollout_share)

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size

    @property
    def uniform(self) -> bool:
        """Every member has the same reward: every advantage in the group is 0."""
        return len({s.reward for s in self.members.values()}) == 1


class SeekToRecorded(ConsumerRebalanceListener):
    """The registry, not the broker's commit, is the record of what was learned; `assigned`
    is what the group gave this learner (on /health: a learner stopped in the middle of
    joining holds the next one's join for up to max_poll_interval_ms)."""

    def __init__(self, consumer: KafkaConsumer, recorded: dict[str, int]):
        self.consumer = consumer
        self.recorded = recorded
        self.assigned: set[str] = set()

    def on_partitions_assigned(self, assigned) -> None:
        for tp in assigned:
            if (key := f"{tp.topic}:{tp.partition}") in self.recorded:
                self.consumer.seek(tp, self.recorded[key])
        self.assigned = {f"{tp.topic}:{tp.partition}" for tp in assigned}

    def on_partitions_revoked(self, revoked) -> None:
        self.assigned = set()


class Learner:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.config = settings.learner
        self.registry = Registry(settings.policies_dir)
        self.state_dir = settings.data_dir / "learner"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        head = self.registry.head()
        assert head is not None, "the stack registers the starter (v0) before the learner starts"
        self.current: PolicyVersion = head
        rewind = self.registry.last_rewind()
        self.applied_rewind = rewind.id if rewind else 0  # head() has taken it into account
        self.trainer = self.trainer_at(self.current)
        self.skill_check = SkillCheck.configured(self.config, settings.rollouts)
        self.own_groups = OwnGroups.configured(self.config, settings.rollouts)
        self.serving: set[str] = set()  # versions on replicas now: their samples are never stale
        self.steps_behind: dict[tuple[str, str], int | None] = {}  # (behaviour, current): Registry.steps_apart
        self.pending: dict[str, RewardedSample] = {}
        self.holdout: list[RewardedSample] = []
        # (version, event id -> mean log-ratio under it) for the held-out samples: what the
        # gate computed for a candidate is its parent's half of the next version's gate.
        self.holdout_ratios: tuple[str, dict[str, float]] = ("", {})
        self.dropped = {"stale": 0, "consent": 0, "malformed": 0, "already_trained": 0, "untrainable": 0,
                        "incomplete_group": 0, "uniform_group": 0}
        self.dropped_ids: list[tuple[str, str]] = []  # (sample id, reason), recorded with the next offsets
        self.open_groups: dict[str, OpenGroup] = {}
        self.replay = ReplayBuffer(self.config.replay_buffer)  # rollout groups trained, for replay_groups
        self.next_offsets: dict[TopicPartition, int] = {}
        self.window_started = time.time()
        self.cluster_id = settings.broker_cluster_id or "external"
        self.committed: dict[TopicPartition, int] = {}
        self.flush_requested = threading.Event()
        self.paused = threading.Event()
        self.halted = threading.Event()  # set by the loop once it has seen `paused`: nothing in flight
        self.assignment: SeekToRecorded | None = None  # the consumer's, once it runs

    def trainer_at(self, version: PolicyVersion) -> Trainer:
        """A trainer from `version`'s weights, with its optimizer state where it was kept
        (on every rank: `learner/distributed.py`)."""
        state = self.state_dir / f"{version.version}.pt"
        return distributed.trainer(Path(version.model_dir), self.config, state if state.exists() else None)

    def rewind_if_asked(self) -> None:
        """Continue from the version the controller put back, if it asked since the last look."""
        rewind = self.registry.last_rewind()
        if rewind is None or rewind.id <= self.applied_rewind:
            return
        target = self.registry.get(rewind.version)
        self.trainer = self.trainer_at(target)
        self.current, self.applied_rewind = target, rewind.id
        VERSION.set(target.seq)
        log(logger, "rewound", version=target.version, reason=rewind.reason)

    def rebase_if_too_far_ahead(self) -> None:
        """Past `max_lead_versions` unserved versions, go on from the newest version serving.

        Samples come from what serves; a chain of versions no user got is trained further
        and further off-policy (the importance weights fall, the entropy collapses:
        docs/history.md), so its lead is bounded as the staleness of samples is."""
        lead, serving = self.config.max_lead_versions, self.serving
        if lead is None or not serving:
            return
        if unserved_chain(self.current, serving, self.registry.get, lead) < lead:
            return  # the next version is at most `lead` ahead
        newest = max((self.registry.get(v) for v in serving), key=lambda v: v.seq)
        self.registry.request_rewind(newest.version, "learner",
                                     f"{self.current.version} is {lead}+ versions ahead of what serves")
        self.rewind_if_asked()

    # --- consuming -------------------------------------------------------------------------
    def consumer(self) -> KafkaConsumer:
        consumer = KafkaConsumer(
            bootstrap_servers=self.settings.bootstrap, group_id=GROUP, enable_auto_commit=False,
            auto_offset_reset="earliest", api_version=KAFKA_PYTHON_API_VERSION,
            max_poll_records=500, max_poll_interval_ms=3_600_000,
            # A learner killed stays a member until the broker has not heard from it for the
            # session timeout, and its successor consumes nothing before then: kafka-python's
            # 30 s at this protocol version made every recovery in the fault suite 63-75 s.
            session_timeout_ms=10_000, heartbeat_interval_ms=2_000,
        )
        self.assignment = SeekToRecorded(consumer, self.registry.offsets(self.cluster_id))
        consumer.subscribe([Topics.SAMPLES], listener=self.assignment)
        return consumer

    def drop(self, reason: str, sample_id: str | None = None) -> None:
        self.dropped[reason] += 1
        DROPPED.labels(reason).inc()
        if sample_id is not None:
            self.dropped_ids.append((sample_id, reason))

    def dead_letter(self, reason: str, payload: bytes, tenant: str | None) -> None:
        """What the learner cannot use goes to the dead-letter topic with the reason."""
        letter = DeadLetter(event_id=f"dlq-{hashlib.sha256(payload).hexdigest()[:32]}",
                            source_topic=Topics.SAMPLES, reason=reason, tenant=tenant,
                            payload=payload.decode(errors="replace"))
        try:
            produce_sync(self.settings, Topics.DEAD_LETTER, encode(letter))
        except Exception as error:  # counted either way; the broker being down is not a sample's fault
            log(logger, "could not dead-letter a sample", reason=reason, error=repr(error))

    def take(self, raw: bytes, position: tuple[TopicPartition, int]) -> None:
        CONSUMED.inc()
        try:
            sample = RewardedSample.model_validate_json(raw)
        except ValidationError as error:
            self.dead_letter(f"malformed: {error.errors()[0]['msg']}", raw, None)
            return self.drop("malformed")
        if (why := problem(sample, self.trainer.arch)) is not None:
            self.dead_letter(f"malformed: {why}", raw, sample.tenant)
            return self.drop("malformed", sample.sample_id)
        if sample.tenant in self.config.excluded_tenants:
            return self.drop("consent", sample.sample_id)
        if self.stale(sample.trajectory.policy_version) or self.waited_too_long(sample):
            return self.drop("stale", sample.sample_id)
        if self.registry.trained([sample.sample_id]):
            return self.drop("already_trained")  # a revision after its sample was learned
        if sample.trajectory.group_size is not None:
            return self.gather(sample, raw, position)
        previous = self.pending.get(sample.sample_id)
        if previous is None or sample.revision > previous.revision:
            self.pending[sample.sample_id] = sample

    def gather(self, sample: RewardedSample, raw: bytes, position: tuple[TopicPartition, int]) -> None:
        """Hold a sized group's members until all have arrived and a version takes the group
        whole (`choose_groups`): a group is trained in one version, never half-scored."""
        trajectory = sample.trajectory
        key = f"{sample.tenant}:{trajectory.group_id}"
        assert trajectory.group_size is not None, "only a sized group's members are gathered"
        group = self.open_groups.setdefault(key, OpenGroup(trajectory.group_size, trajectory.policy_version))
        if (trajectory.group_size, trajectory.policy_version) != (group.size, group.policy_version):
            self.dead_letter(f"malformed: group {trajectory.group_id} has members of size {group.size} from "
                             f"{group.policy_version}, this one says {trajectory.group_size} from "
                             f"{trajectory.policy_version}", raw, sample.tenant)
            return self.drop("malformed", sample.sample_id)
        previous = group.members.get(sample.sample_id)
        if previous is None or sample.revision > previous.revision:
            group.members[sample.sample_id] = sample
        tp, offset = position
        group.first_offsets[tp] = min(offset, group.first_offsets.get(tp, offset))
        if self.config.drop_uniform_groups and group.complete and group.uniform and not held_out(
                sample, self.config.holdout_fraction):  # the gate still sees its reward
            del self.open_groups[key]
            for sample_id in group.members:
                self.drop("uniform_group", sample_id)

    def stale(self, version: str) -> bool:
        """Samples of `version` are too far behind the learner to train on: more than
        `max_version_lag` training steps from its weights (`Registry.steps_apart`). What serves now
        (stable, a canary, lent replicas) never is: while a canary is judged the learner
        writes candidates on, and stable's traffic must not be thrown away."""
        if version in self.serving:
            return False
        key = (version, self.current.version)
        if key not in self.steps_behind:  # every sample asks: one lineage walk per version pair
            if len(self.steps_behind) > 1024:
                self.steps_behind.clear()
            self.steps_behind[key] = self.registry.steps_apart(version, self.current.version,
                                                               self.config.max_version_lag)
        return self.steps_behind[key] is None

    def waited_too_long(self, sample: RewardedSample) -> bool:
        """The sample waited on the topic (since the stream emitted it) longer than
        `max_sample_wait_s`: a learner that cannot keep up trains on what is fresh and drops
        the rest by id, so its place in the log, which retention keeps, stays recent."""
        limit = self.config.max_sample_wait_s
        return limit is not None and time.time() - sample.timestamp.timestamp() > limit

    def serving_versions(self) -> set[str]:
        """The versions replicas serve now: stable, a canary, and what lent replicas sample
        rollouts from (the learner's newest)."""
        return ({v.version for state in ("stable", "canary") for v in self.registry.in_state(state)}
                | {r.policy_version for r in read_pool(self.settings).lent})

    def complete_groups(self) -> dict[str, OpenGroup]:
        return {key: g for key, g in self.open_groups.items() if g.complete}

    def expire_groups(self) -> None:
        """Give up groups that stayed incomplete (a rollout cut short, a worker that died)."""
        now = time.time()
        for key, group in list(self.open_groups.items()):
            if not group.complete and now - group.opened > self.config.group_timeout_s:
                del self.open_groups[key]
                for sample_id in group.members:
                    self.drop("incomplete_group", sample_id)

    def take_groups(self) -> list[OpenGroup]:
        """The complete groups this version trains (`choose_groups`), no longer open; the
        rest wait for the next version, whole. A group that `rollout_share` held back until
        its version fell more than `max_version_lag` behind is dropped as stale instead: it
        was fresh when it arrived, but unlike a lone sample it waited (for versions)."""
        for key, group in list(self.complete_groups().items()):
            if group.passed_over and self.stale(group.policy_version):
                del self.open_groups[key]
                for sample_id in group.members:
                    self.drop("stale", sample_id)
        ready = self.complete_groups()
        chosen = choose_groups(list(ready.values()), len(self.pending), self.config.rollout_share)
        taken = {id(g) for g in chosen}
        for key, group in ready.items():
            if id(group) in taken:
                del self.open_groups[key]
            else:
                group.passed_over += 1
        return chosen

    def safe_offsets(self) -> dict[TopicPartition, int]:
        """Consumed offsets, held back to the first member of any group not yet trained
        (incomplete, or complete and waiting for a version): a restart reads those members
        again (samples trained meanwhile are skipped as already trained)."""
        held: dict[TopicPartition, int] = {}
        for group in self.open_groups.values():
            for tp, offset in group.first_offsets.items():
                held[tp] = min(offset, held.get(tp, offset))
        return {tp: min(offset, held.get(tp, offset)) for tp, offset in self.next_offsets.items()}

    def due(self) -> bool:
        """Enough samples for a version: production's and the groups it would take."""
        chosen = choose_groups(list(self.complete_groups().values()), len(self.pending), self.config.rollout_share)
        n = len(self.pending) + sum(g.size for g in chosen)
        return n >= self.config.batch_samples or (
            n >= self.config.min_samples and time.time() - self.window_started >= self.config.max_interval_s)

    # --- learning ----------------------------------------------------------------------------
    def window(self, samples: list[RewardedSample]) -> SampleWindow:
        served = [s.trajectory.timestamp.timestamp() for s in samples]
        per_version: dict[str, int] = {}
        for s in samples:
            per_version[s.trajectory.policy_version] = per_version.get(s.trajectory.policy_version, 0) + 1
        return SampleWindow(
            cluster_id=self.cluster_id,
            offsets={f"{tp.topic}:{tp.partition}": o for tp, o in self.safe_offsets().items()},
            first_served=min(served), last_served=max(served), samples=len(samples),
            dropped_stale=self.dropped["stale"], dropped_consent=self.dropped["consent"],
            per_version=per_version,
        )

    def beside_production(self, chosen: list[OpenGroup]) -> tuple[list[RewardedSample], list[RewardedSample]]:
        """What a version with production samples trains beside them: rollout groups trained
        before, replayed (learner/mix.py), and the learner's own groups (learner/own_groups.py).
        Neither is learned again in the registry's record. The fresh groups join the replay."""
        replayed = self.replay.take(self.config.replay_groups - len(chosen)) if self.pending else []
        upcoming = (self.registry.latest() or self.current).seq + 1  # each retry after a rewind draws anew
        own = self.own_groups.sample(self.trainer, self.current.version, upcoming) if (
            self.own_groups and self.pending) else []
        self.replay.remember([s for s in g.members.values() if not held_out(s, self.config.holdout_fraction)]
                             for g in chosen if not g.uniform)
        return replayed, own

    def learn(self, consumer: KafkaConsumer) -> PolicyVersion:
        chosen = self.take_groups()
        # In a fixed order: a version is a function of its parent and its samples, not of
        # the order the partitions delivered them in.
        batch = sorted(list(self.pending.values()) + [s for g in chosen for s in g.members.values()],
                       key=lambda s: s.sample_id)
        train = [s for s in batch if not held_out(s, self.config.holdout_fraction)]
        self.holdout = (self.holdout + [s for s in batch if held_out(s, self.config.holdout_fraction)])[-512:]
        replayed, own = self.beside_production(chosen)
        if self.config.kl_coef > 0 and self.config.kl_reference == "stable":
            self.trainer.use_reference(Path(self.stable().model_dir))
        started = time.time()
        step = settled_step([s.reward for s in self.pending.values()], len(chosen), self.config.settled_reward,
                            self.config.settled_lr_scale) * held_step(
            self.registry.rewinds_since(self.stable().version), self.config.held_lr_scale, self.config.held_lr_floor)
        metrics = self.trainer.train((train or batch) + replayed + own, seed=self.current.seq, lr_scale=step,
                                     anchor=self.replay.passed(self.config.skill_anchor_samples, self.current.seq),
                                     skill_check=self.skill_check, skill_floor=self.skill_floor())
        crash_point("learner.after_train")
        metrics["replayed_samples"] = len(replayed)
        metrics["own_samples"], metrics["own_reward"] = len(own), sum(s.reward for s in own) / max(len(own), 1)
        metrics["own_seconds"] = self.own_groups.seconds if self.own_groups and own else 0.0
        metrics["lr_scale"] = step  # below 1: a settled version, or one after the guard rewound (learner/mix.py)
        metrics["train_seconds"] = time.time() - started
        metrics["tokens_per_second"] = metrics["tokens"] * self.config.epochs / max(metrics["train_seconds"], 1e-9)
        for sample in batch:  # each poison pill is dead-lettered once, counted in this version
            if why := metrics["untrainable"].get(sample.sample_id):
                self.dead_letter(why, encode(sample), sample.tenant)
                self.drop("untrainable", sample.sample_id)
        metrics["dropped"] = dict(self.dropped)
        metrics["after_rewind"] = self.applied_rewind  # Registry.head: trained after that rewind
        staged = self.settings.policies_dir / "staging-learner"
        shutil.rmtree(staged, ignore_errors=True)
        started = time.time()
        self.trainer.export(staged)
        metrics["export_seconds"] = time.time() - started
        if self.holdout:
            started = time.time()
            candidate_ratios = self.trainer.mean_log_ratios(self.holdout)
            metrics["gate"] = self.offline_gate(candidate_ratios, staged).model_dump()
            metrics["gate_seconds"] = time.time() - started
        # Named after the version once the registry has given it its name (after a rewind
        # the next version is not current + 1); a crash in between loses only this
        # version's Adam state, and a rewind to it starts Adam afresh.
        unnamed_state = self.state_dir / "unpublished.pt"
        self.trainer.save_state(unnamed_state)
        crash_point("learner.after_save_state")
        version = self.registry.publish(
            staged, parent=self.current.version, window=self.window(batch), metrics=metrics,
            sample_ids=[s.sample_id for s in batch], actor="learner", dropped=self.dropped_ids,
        )
        unnamed_state.replace(self.state_dir / f"{version.version}.pt")
        if self.skill_check is not None:
            self.skill_check.remember(version.version)
        if self.holdout:
            self.holdout_ratios = (version.version, {s.event_id: r for s, r in
                                                     zip(self.holdout, candidate_ratios.tolist(), strict=True)})
        if (gate := metrics.get("gate")) and gate["too_far_from_stable"]:
            # Every version trained on top would be further still: continue from what users get.
            self.registry.request_rewind(self.stable().version, "learner", f"{version.version} {gate['reason']}")
        # After the registry has it: a crash here re-reads the offsets from the registry.
        crash_point("learner.after_publish")
        self.commit(consumer)
        crash_point("learner.after_commit")
        log(logger, "version written", version=version.version, samples=len(batch),
            reward=metrics["mean_reward"], seconds=round(metrics["train_seconds"], 2))
        self.current = version
        self.pending.clear()
        self.dropped, self.dropped_ids = dict.fromkeys(self.dropped, 0), []
        self.window_started = time.time()
        VERSION.set(version.seq)
        if self.settings.sync.transport == "delta":  # in the store before a swap looks for it
            ship(self.settings, self.registry)
        for state in self.state_dir.glob("*.pt"):  # kept while retention keeps the weights (a rewind's)
            if not (self.settings.policies_dir / state.stem).exists():
                state.unlink()
        return version

    def skill_floor(self) -> float | None:
        """The least share of the learner's check tasks its next version may solve (learner/skill_check.py)."""
        if self.skill_check is None:
            return None
        stable = self.stable()
        return self.skill_check.floor((self.current.version, self.current.model_dir),
                                      (stable.version, stable.model_dir))

    def offline_gate(self, candidate_ratios: torch.Tensor, staged: Path) -> Verdict:
        """The candidate against its parent on the held-out samples (policies/offline_eval.py)."""
        rewards = torch.tensor([s.reward for s in self.holdout])
        parent_ratios, clip = self.parent_log_ratios(), self.config.gate_clip
        return offline_check(snis(candidate_ratios, rewards, clip), snis(parent_ratios, rewards, clip),
                             snis_difference(candidate_ratios, parent_ratios, rewards, clip),
                             self.config.gate_margin, self.config.gate_min_ess,
                             self.kl_from_stable(staged), self.config.gate_max_kl)

    def stable(self) -> PolicyVersion:
        """What users get: the starter is stable from the start, and a version leaves stable
        only when another takes its place."""
        stable = self.registry.stable()
        assert stable is not None, "the registry always has a stable version"
        return stable

    def parent_log_ratios(self) -> torch.Tensor:
        """The held-out samples' mean log-ratios under the parent: those the parent's own
        gate computed, and the rest (held out since, or all after a rewind or restart)
        computed now, so each version's gate evaluates the parent on new samples only."""
        version, known = self.holdout_ratios
        known = dict(known) if version == self.current.version else {}
        if missing := [s for s in self.holdout if s.event_id not in known]:
            known.update(zip((s.event_id for s in missing),
                             self.trainer.mean_log_ratios(missing, of_parent=True).tolist(), strict=True))
        return torch.tensor([known[s.event_id] for s in self.holdout])

    def kl_from_stable(self, staged: Path) -> float | None:
        """KL(stable || staged) on the newest held-out logged samples: how far users would move."""
        stable = self.registry.stable()
        held = self.holdout[-self.config.gate_kl_samples:] if self.config.gate_kl_samples else []
        if stable is None or not held:
            return None
        return kl_between(Path(stable.model_dir), staged, [
            (s.trajectory.prompt_token_ids + s.trajectory.completion_token_ids, len(s.trajectory.prompt_token_ids))
            for s in held if not s.trajectory.multi_turn()])  # what users are served: single turns

    def commit(self, consumer: KafkaConsumer) -> None:
        offsets = self.safe_offsets()
        consumer.commit({tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()})
        self.committed = offsets

    def settle(self, consumer: KafkaConsumer) -> None:
        """Nothing pending, yet offsets moved (all dropped): record them, so a drain ends."""
        if not self.pending and self.safe_offsets() != self.committed:
            self.registry.record_offsets(
                self.cluster_id, {f"{tp.topic}:{tp.partition}": o for tp, o in self.safe_offsets().items()},
                self.dropped_ids)
            self.dropped_ids = []
            self.commit(consumer)

    def run(self, stop: threading.Event) -> None:
        consumer = self.consumer()
        VERSION.set(self.current.seq)
        try:
            while not stop.is_set():
                self.rewind_if_asked()
                self.serving = self.serving_versions()
                if self.paused.is_set():  # on-call paused learning: consume nothing, write nothing
                    self.halted.set()
                    time.sleep(0.2)
                    continue
                for tp, records in consumer.poll(timeout_ms=500).items():
                    for record in records:
                        self.take(record.value, (tp, record.offset))
                        self.next_offsets[tp] = record.offset + 1
                self.expire_groups()
                PENDING.set(len(self.pending))
                if self.due() or (self.flush_requested.is_set() and (self.pending or self.complete_groups())):
                    self.rebase_if_too_far_ahead()
                    self.learn(consumer)
                self.flush_requested.clear()
                self.settle(consumer)
        finally:
            consumer.close(autocommit=False)


def create_app(settings: Settings) -> tuple[FastAPI, Learner]:
    learner = Learner(settings)

    def health() -> dict:
        return {"ok": True, "version": learner.current.version, "pending": len(learner.pending),
                "paused": learner.paused.is_set(), "dropped_since_last_version": dict(learner.dropped),
                "partitions": sorted(learner.assignment.assigned) if learner.assignment else [],
                # Groups still missing members: their offsets stay uncommitted (read again after a restart).
                "open_groups": sum(not g.complete for g in learner.open_groups.values())}

    app = service_app("liverl learner", settings, health)

    @app.post("/pause")
    def pause(audit: Audit, reason: str = "", wait_s: float = Query(600.0, ge=0, le=3600, description=(
            "How long to wait for a step in flight to finish")),
              key: KeyRecord = Depends(require_admin)) -> dict:
        """Stop consuming and writing versions (admin key; audited). Answers once the step in
        flight has finished, so no version is published after it (`halted` false: still
        finishing after `wait_s`)."""
        learner.halted.clear()  # after `paused` is set, only a loop that has seen it sets this
        learner.paused.set()
        audit.record(key.key_id, "learner.pause", "learner", reason, version=learner.current.version)
        halted = learner.halted.wait(wait_s)
        return {"paused": True, "halted": halted, "version": learner.current.version}

    @app.post("/resume")
    def resume(audit: Audit, reason: str = "", key: KeyRecord = Depends(require_admin)) -> dict:
        learner.paused.clear()
        audit.record(key.key_id, "learner.resume", "learner", reason, version=learner.current.version)
        return {"paused": False, "version": learner.current.version}

    @app.post("/flush")
    def flush(audit: Audit, reason: str = "", key: KeyRecord = Depends(require_admin)) -> dict:
        """Learn from whatever is pending now (a clean shutdown must not strand samples)."""
        learner.flush_requested.set()
        audit.record(key.key_id, "learner.flush", "learner", reason, pending=len(learner.pending))
        return {"pending": len(learner.pending)}

    return app, learner


if __name__ == "__main__":
    settings = get_settings()
    distributed.run_on_ranks(settings.learner.ranks, "learner.service")
    try:
        if distributed.start() == 0:
            app, learner = create_app(settings)
            serve_beside(app, settings.host, settings.ports.learner, learner.run)
        else:
            distributed.follow()
    finally:
        distributed.finish()
