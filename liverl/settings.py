"""All of liverl's configuration, in one place.

Every field is typed and described. Values come from defaults, then the deployment's
TOML file named by `LIVERL_CONFIG_FILE` (a table per section, e.g. `[promotion]`: the
promotion analysis in docs/production.md), then `LIVERL_*` environment variables
(nested with `__`, e.g. `LIVERL_BROKER__BOOTSTRAP=...`), then CLI flags. Each
embedded-or-server choice is a discriminated union of small configs.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    HttpUrl,
    SecretStr,
    Tag,
    ValidationError,
    field_serializer,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

Port = Annotated[int, Field(ge=1, le=65535)]
Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]


class Config(BaseModel):
    """A section of the settings: a misspelt field is an error, and so is a bad value
    assigned after construction (the CLI's flags are assigned)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def reveal_secret(value: SecretStr | None, info) -> str | None:
    """Secrets stay out of every dump (the settings file, logs) unless the dump is the
    environment of a child process, which asks with context {"secrets": True}."""
    if value is None:
        return None
    return value.get_secret_value() if (info.context or {}).get("secrets") else "**********"


# --- Kafka-protocol broker ---------------------------------------------------------
class EmbeddedBroker(Config):
    """Tansu, started by `liverl up`; its topics on disk through a local S3-compatible store
    (app/broker.py), or in memory."""

    kind: Literal["embedded"] = "embedded"
    port: Port = Field(19092, description="Port the embedded Tansu broker listens on.")
    storage: Literal["disk", "memory"] = Field(
        "disk", description="disk: topics kept as files under data_dir/broker, so what the broker acknowledged "
        "survives a kill of it; memory: lost with the broker (nothing written, for throwaway runs).")
    store_port: Port | None = Field(None, description="Port of the store (app.broker_store) that keeps the "
                                    "topics on disk (storage disk); None: the broker's port + 1.")
    fsync: bool = Field(False, description="The store fsyncs each batch before the broker acknowledges it: "
                        "survives a power cut, not only a kill, at the cost of a disk flush per produce.")
    partitions: int = Field(2, ge=1, description="Partitions per topic created at start.")
    retention_hours: float | None = Field(
        168.0, gt=0, description="Batches older than this that every consumer group has read are deleted "
        "(storage disk; topics with cleanup.policy=compact: only superseded ones); None: kept forever.")
    retention_bytes: int | None = Field(
        None, gt=0, description="Per partition: read batches are deleted, oldest first, whatever their age, "
        "while the partition holds more than this (storage disk); None: no size limit.")
    retention_batches: int | None = Field(
        200, gt=0, description="Per partition: read batches are deleted, oldest first, whatever their age, "
        "while the partition holds more than this many (storage disk). Tansu 0.6's produce and fetch cost in "
        "proportion to a partition's batches (docs/reliability.md); None: no count limit.")
    retention_check_s: float = Field(5.0, gt=0, description="How often the store applies retention (a "
                                     "partition grows by this many seconds of batches past retention_batches).")
    min_free_bytes: int = Field(
        1 << 30, ge=0, description="The store refuses new batches (the producer's ack fails: ingest answers 503) "
        "while its volume has less free space than this, and alerts broker_disk_low once per episode.")

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def effective_store_port(self) -> int:
        """The store's port."""
        return self.store_port or self.port + 1


class KafkaBroker(Config):
    """An external Apache Kafka cluster (production)."""

    kind: Literal["kafka"] = "kafka"
    bootstrap: str = Field("kafka:9092", description="Comma-separated bootstrap servers.")
    partitions: int = Field(6, ge=1, description="Partitions per topic when liverl creates them.")
    replication_factor: int = Field(3, ge=1, description="Replication factor for created topics.")


SECRET_FIELDS = {"warehouse": {"password"}, "delta_store": {"secret_access_key"}}

def kind_or(default: str) -> Discriminator:
    """Tell an embedded-or-server choice by its `kind`, the embedded one when none is given: so
    `LIVERL_BROKER__STORAGE=memory` alone sets a field of the default broker."""
    def kind(value: object) -> str:
        return value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)
    return Discriminator(kind)


BrokerConfig = Annotated[Annotated[EmbeddedBroker, Tag("embedded")] | Annotated[KafkaBroker, Tag("kafka")],
                         kind_or("embedded")]


# --- ClickHouse ------------------------------------------------------------------------
class WarehouseWrites(Config):
    """How the sink writes, whichever ClickHouse it writes to."""

    batch_s: float = Field(
        0.5, ge=0, le=10, description="How long the sink gathers events before it writes them: ClickHouse "
        "wants few large inserts, and each write costs a duplicate check and an insert, whatever its size.",
    )
    remember_keys: bool = Field(
        True, description="Hold an 8-byte hash of every stored row's key in the sink's memory (80 MB for ten "
        "million rows), so ClickHouse is asked only about rows it may hold: nearly every row is new.",
    )


class ChdbWarehouse(WarehouseWrites):
    """Embedded ClickHouse (chdb), owned by the sink process (one process per path)."""

    kind: Literal["chdb"] = "chdb"
    subdir: str = Field("chdb", description="Data path, relative to the data directory.")


class ClickHouseServer(WarehouseWrites):
    """A clickhouse-server reached with clickhouse-connect (production)."""

    kind: Literal["server"] = "server"
    host: str = Field("clickhouse", description="ClickHouse server host.")
    port: Port = Field(8123, description="ClickHouse HTTP port.")
    username: str = Field("default", description="ClickHouse user.")
    password: SecretStr | None = Field(
        None, description="ClickHouse password: from LIVERL_WAREHOUSE__PASSWORD, never written to a file or log.",
    )
    database: str = Field("liverl", description="Database holding liverl's tables.")

    _password = field_serializer("password")(reveal_secret)


WarehouseConfig = Annotated[Annotated[ChdbWarehouse, Tag("chdb")] | Annotated[ClickHouseServer, Tag("server")],
                            kind_or("chdb")]


# --- Delta store -------------------------------------------------------------------------
class LocalDeltaStore(Config):
    """Policy deltas and snapshots in a local directory."""

    kind: Literal["local"] = "local"
    subdir: str = Field("deltas", description="Store path, relative to the data directory.")


class S3DeltaStore(Config):
    """Policy deltas and snapshots in an S3-compatible bucket (production)."""

    kind: Literal["s3"] = "s3"
    endpoint_url: str | None = Field(None, description="S3 endpoint; None means AWS.")
    bucket: str = Field("liverl-policies", description="Bucket holding deltas and snapshots.")
    prefix: str = Field("", description="Key prefix inside the bucket.")
    access_key_id: str | None = Field(None, description="Access key (never logged).")
    secret_access_key: SecretStr | None = Field(
        None, description="Secret key: from LIVERL_DELTA_STORE__SECRET_ACCESS_KEY, never written to a file or log.",
    )

    _secret = field_serializer("secret_access_key")(reveal_secret)


DeltaStoreConfig = Annotated[Annotated[LocalDeltaStore, Tag("local")] | Annotated[S3DeltaStore, Tag("s3")],
                             kind_or("local")]


class SyncConfig(Config):
    """How policy versions travel from the learner to the replicas (sync/)."""

    transport: Literal["delta", "full"] = Field(
        "delta", description="Ship verified deltas through the delta store, or load the registry's directory."
    )
    snapshot_every: int = Field(10, ge=1, description="Also store a full snapshot of every Nth version.")
    keep_versions: int = Field(8, ge=1, description="Newest versions the delta store and the registry keep besides "
                               "those still needed.")
    fetch_retries: int = Field(3, ge=0, description="Extra fetches of a chunk that arrives corrupted or short.")
    delta_format: Literal[1, 2] = Field(
        2, description="Delta format the learner writes (sync.delta): 2 codes each change given the base's "
        "exponents; 1 while a replica runs an older liverl."
    )


# --- Components ----------------------------------------------------------------------------
class PortsConfig(Config):
    api: Port = Field(18080, description="Ingest + admin API port.")
    gateway: Port = Field(18000, description="OpenAI-compatible serving gateway port.")
    sink: Port = Field(18090, description="Analytics sink (ClickHouse owner) port.")
    feedback: Port = Field(18070, description="Faust feedback worker web port.")
    learner: Port = Field(18060, description="Learner metrics/admin port.")
    controller: Port = Field(18050, description="Promotion controller's health and admin port.")
    capacity: Port = Field(18040, description="Capacity scheduler's health and metrics port.")
    rollouts: Port = Field(18030, description="Rollout worker's health and metrics port.")
    evaluator: Port = Field(18020, description="Held-out evaluator's health port.")
    supervisor: Port = Field(18010, description="Supervisor's health, metrics and restart port.")
    replica_base: Port = Field(18100, description="First vLLM replica port; replica i uses base+i.")

    def shifted(self, by: int) -> PortsConfig:
        """Every port moved by `by`: another stack beside this one (tests, benchmarks)."""
        return PortsConfig(**{name: port + by for name, port in self.model_dump().items()})


class StarterPolicyConfig(Config):
    """The small Qwen3-MoE the embedded default serves first: shipped in policies/starter_model
    (seed 0, each file checked against its SHA-256 at use), or built from its recipe for another seed."""

    seed: int = Field(0, description="Seed for tokenizer corpus order, init and mid-training: 0 takes the shipped "
                      "starter, any other builds it from the recipe (about 10 minutes on two cores).")
    cache_dir: Path = Field(
        REPO_ROOT / ".liverl/starter", description="Where the starter policy is kept: a verified copy of the "
        "shipped one, or built once per machine."
    )
    model_dir: Path | None = Field(
        None, description="Serve this HF checkpoint instead of the starter policy."
    )


class ServingConfig(Config):
    replicas: int = Field(1, ge=1, le=64, description="vLLM replicas behind the gateway.")
    python: Path = Field(
        REPO_ROOT / ".venv-serving/bin/python", description="Interpreter of the serving env."
    )
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per CPU replica (GiB).")
    cpu_threads: int = Field(1, ge=1, description="OMP threads per CPU replica.")
    replica_cpus: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] | None = Field(
        None, description="CPUs each CPU replica may run on, as a device of its own: replica-i gets entry i "
        "modulo the list's length (None: any CPU).",
    )
    executor: Literal["uni", "mp"] = Field(
        "uni", description="vLLM executor: uni runs the model in the engine-core process (one device "
        "per replica); mp, vLLM's CPU default and what tensor parallelism needs, in worker processes "
        "that spin a core for a second after every message.",
    )
    listen: Literal["unix", "tcp"] = Field(
        "unix", description="unix: each replica listens on a socket in a directory only liverl's "
        "user can open, so no other local process reaches vLLM's dev endpoints; tcp: on "
        "ports.replica_base + i, for replicas in other hosts or containers (a network policy must "
        "then keep everyone but the gateway and the swap code out).",
    )
    canary_share: Fraction = Field(0.1, description="Share of sessions a canary serves (the rest go to stable); "
                                   "a session keeps its version (header x-liverl-session, else the request's "
                                   "`user`; requests with neither are assigned one by one).")
    max_model_len: int = Field(512, ge=16, description="Longest prompt + completion served.")
    aot_compile: bool = Field(
        False, description="vLLM's AOT compile artifacts, keyed by the model's path: vllm-cpu 0.32 fails to load "
        "them, so every start compiled again (51 s of a 76-s start on two cores); off, torch's own caches, keyed by "
        "the graph, serve every version of an architecture compiled once on the machine (docs/benchmarks.md).",
    )
    dtype: str = Field("float32", description="Compute dtype of the replicas (fp32 on CPU).")
    start_timeout_s: float = Field(240.0, gt=0, description="How long a replica may take to start.")
    request_timeout_s: float = Field(120.0, gt=0, description="Gateway -> replica request timeout.")
    no_replica_wait_s: float = Field(
        30.0, ge=0, description="How long a request waits for a replica while every one is swapping."
    )
    tenant_requests_per_s: float = Field(
        200.0, ge=0, description="Completions per second one tenant may request through one gateway process "
        "(0: unlimited); more is answered 429.",
    )
    tenant_requests_burst: float = Field(
        400.0, gt=0, description="Requests one tenant may send at once before its rate applies.",
    )
    swap: Literal["inplace", "restart"] = Field(
        "inplace", description="Load new weights into the running engine, or blue/green restart."
    )
    swap_drain_s: float = Field(
        5.0, ge=0, description="How long an in-place swap lets the replica finish its in-flight requests "
        "on the old weights before pausing whatever is left (kept, re-prefilled on the new ones).",
    )
    outbox_bytes: int = Field(
        256 * 1024**2, ge=0, description="Bytes of records the broker did not take that the gateway keeps on disk "
        "(data_dir/outbox/gateway) to re-publish; a record past them is dropped and counted.",
    )


class FeedbackConfig(Config):
    @model_validator(mode="after")
    def _sweep_within_window(self):
        if self.sweep_interval_s > self.reward_window_s:
            raise ValueError(f"LIVERL_FEEDBACK__SWEEP_INTERVAL_S ({self.sweep_interval_s}) must not exceed "
                             f"LIVERL_FEEDBACK__REWARD_WINDOW_S ({self.reward_window_s})")
        return self

    reward_window_s: float = Field(
        3600.0, gt=0, description="How long after a completion feedback still joins it on time."
    )
    sweep_interval_s: float = Field(5.0, gt=0, description="How often due windows are closed while no events arrive.")
    workers: int = Field(1, ge=1, le=10, description="Stream workers in one consumer group (web ports feedback, "
                         "feedback + 1, ...): they share the topics' partitions, and a dead worker's partitions "
                         "pass, with their table state, to the others. More than the partitions: some idle.")
    batch_events: int = Field(
        2000, ge=1, description="Events the join takes at once (one table write per changed completion per batch).",
    )
    batch_s: float = Field(0.05, gt=0, le=5, description="How long the join waits to fill a batch before it goes on.")
    max_unjoined_per_tenant: int = Field(
        1_000_000, ge=1, description="Feedback events a tenant may have waiting for their trajectories (about "
        "1 KB each); more go to the dead-letter topic.",
    )
    max_feedback_per_completion: int = Field(
        64, ge=1, description="Feedback events one completion may collect; more go to the dead-letter topic.",
    )
    reward_config: Path | None = Field(
        None, description="YAML of per-tenant reward functions; None uses the defaults."
    )


class IngestConfig(Config):
    @model_validator(mode="after")
    def _item_fits_body(self):
        if self.max_item_bytes > self.max_body_bytes:
            raise ValueError(f"LIVERL_INGEST__MAX_ITEM_BYTES ({self.max_item_bytes}) must not exceed "
                             f"LIVERL_INGEST__MAX_BODY_BYTES ({self.max_body_bytes})")
        return self

    max_batch_items: int = Field(1000, ge=1, description="Most items accepted in one ingestion batch.")
    max_item_bytes: int = Field(64 * 1024, ge=1024,
                                description="Largest accepted item, in JSON bytes of the event written to Kafka.")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    delivery_timeout_s: float = Field(30.0, gt=0, description="How long an item may wait for the broker's ack "
                                      "before it is answered 503.")
    tenant_events_per_s: float = Field(
        50_000.0, ge=0, description="Events per second one tenant may send to one API process (0: unlimited); "
        "more is answered 429.",
    )
    tenant_events_burst: float = Field(
        100_000.0, gt=0, description="Events one tenant may send at once before its rate applies.",
    )


class LoraConfig(Config):
    """Low-rank adapters (peft) instead of full weights: the base stays frozen, each version
    publishes the base with the adapters merged (bf16), so replicas serve it as any other."""

    rank: int = Field(16, ge=1, description="Rank r of each adapter.")
    alpha: int = Field(32, ge=1, description="Scale numerator: an adapter adds (alpha / r) * B @ A.")
    targets: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"],
                               description="Module names adapted (nn.Linear layers).")
    router: bool = Field(True, description="Adapt the MoE routers too (as raw parameters: peft's "
                         "target_parameters; transformers 5 keeps routers and experts as parameters).")


class LearnerConfig(Config):
    @model_validator(mode="after")
    def _batch_bounds(self):
        if self.min_samples > self.batch_samples:
            raise ValueError(f"LIVERL_LEARNER__MIN_SAMPLES ({self.min_samples}) must not exceed "
                             f"LIVERL_LEARNER__BATCH_SAMPLES ({self.batch_samples})")
        if self.lora is not None and self.kl_coef > 0 and self.kl_reference == "stable":
            raise ValueError("LIVERL_LEARNER__LORA trains adapters the stable version does not have: "
                             "its KL reference is each version's parent (LIVERL_LEARNER__KL_REFERENCE=parent)")
        if self.lora is not None and self.frozen_parameters:
            raise ValueError("LIVERL_LEARNER__LORA trains adapters on a frozen base: "
                             "LIVERL_LEARNER__FROZEN_PARAMETERS has nothing to freeze beside it")
        if self.own_groups and self.ranks > 1:
            raise ValueError("LIVERL_LEARNER__OWN_GROUPS needs one rank (LIVERL_LEARNER__RANKS=1): the learner samples "
                             "them from the trainer's weights, which several ranks hold in shards")
        if self.skill_check_tasks and self.ranks > 1:
            raise ValueError("LIVERL_LEARNER__SKILL_CHECK_TASKS needs one rank (LIVERL_LEARNER__RANKS=1): the check "
                             "solves its tasks on the trainer's weights, which several ranks hold in shards")
        if self.target_kl is not None and not self.lr_min <= self.lr <= self.lr_max:
            raise ValueError(f"LIVERL_LEARNER__LR ({self.lr}) must lie within LIVERL_LEARNER__LR_MIN "
                             f"({self.lr_min}) and LIVERL_LEARNER__LR_MAX ({self.lr_max}) when "
                             f"LIVERL_LEARNER__TARGET_KL is set")
        return self

    enabled: bool = Field(True, description="Start the learner with the stack.")
    nice: int = Field(15, ge=-20, le=19, description="CPU niceness of the learner: on a shared machine it "
                      "trains in what ingest, serving and the stream leave (it falls behind and drops stale "
                      "samples by design); below 0 (needs CAP_SYS_NICE) it trains ahead of them, as the two-core day "
                      "demo's does.")
    batch_samples: int = Field(256, ge=1, description="Train a candidate once this many samples arrived.")
    max_interval_s: float = Field(3 * 3600.0, gt=0, description="...or once this long passed with any.")
    min_samples: int = Field(8, ge=1, description="Fewest samples worth a version when time is up.")
    max_version_lag: int = Field(4, ge=0, description="Drop samples whose version is more training steps "
                                 "(parent links, not version numbers) from the learner's weights than this.")
    max_sample_wait_s: float | None = Field(
        300.0, gt=0, description="Drop samples that waited on the samples topic longer than this (stale): under "
        "sustained overload the learner skips to fresh feedback instead of falling ever further behind, whose "
        "consumer group would hold the samples log (docs/reliability.md, the soak); None: no limit.")
    rollout_share: Fraction | None = Field(None, description="Most share of a version's samples from rollout "
                                           "groups while production samples wait too (whole groups, oldest first; "
                                           "the rest wait); None: every complete group. Alone, rollouts train alone.")
    replay_groups: int = Field(0, ge=0, description="Rollout groups already trained that a version with production "
                               "samples trains again, less the fresh groups it takes (lending comes in troughs; "
                               "production alone trains away what rollouts taught: docs/learning.md); 0: none.")
    replay_buffer: int = Field(64, ge=1, description="Most recent trained rollout groups kept for replay_groups.")
    own_groups: int = Field(0, ge=0, description="Rollout groups the learner samples itself from each version's "
                            "parent (tasks of the rollout environment's training split, at its temperature, scored "
                            "by it) and trains beside a version's production samples: on-policy teaching between "
                            "the troughs that lend replicas (`learner/own_groups.py`); 0: none.")
    skill_anchor_coef: float = Field(
        0.0, ge=0.0, description="Weight of the skill anchor: each step pulls back up, token by token, what it "
        "lowered below the parent's likelihood of rollout completions that passed (`learner/rl.py: "
        "skill_anchor_loss`, PPO-ptx made one-sided), from the replay buffer; 0: off.")
    skill_anchor_samples: int = Field(16, ge=1, description="Passed rollout completions each version anchors "
                                      "(a different draw from the replay buffer each version).")
    settled_reward: float | None = Field(
        None, description="Mean reward of a version's production samples from which production counts as "
        "learned: a version without fresh rollout groups then steps settled_lr_scale of the lr, so what "
        "production still teaches costs less of the skill rollouts taught (docs/learning.md); None: off.")
    settled_lr_scale: float = Field(0.5, gt=0.0, le=1.0, description="A settled version's step, as a share of "
                                    "the lr (the adaptive step size is not adapted by it).")
    held_lr_scale: float | None = Field(
        None, gt=0.0, lt=1.0, description="After the guard puts the learner back (a candidate held for skill "
        "or aborted), versions step this share of the lr, once more per further rewind since stable was "
        "promoted, until another is (`learner/mix.py: held_step`); None: off.")
    held_lr_floor: float = Field(0.125, gt=0.0, le=1.0, description="Smallest share of the lr held_lr_scale "
                                 "goes down to.")
    group_timeout_s: float = Field(900.0, gt=0, description="A sized group (rollouts) still incomplete after "
                                   "this long is given up, its members counted as dropped, never half-trained.")
    max_lead_versions: int | None = Field(
        None, ge=1, description="Most versions the learner's chain may run ahead of the newest version "
        "serving (canary, else stable); past it the learner goes on from that version. None: unbounded.",
    )
    objective: Literal["reinforce", "ppo", "gspo", "cispo"] = Field(
        "reinforce", description="Policy-gradient objective (`learner/rl.py`): off-policy REINFORCE, or a "
        "trust region around the version's parent: PPO-clip, GSPO (sequence ratio), CISPO (clipped weight).",
    )
    proximal: Literal["parent", "behaviour"] = Field(
        "parent", description="Centre of the trust region: the version's parent (decoupled PPO), or the "
        "version that served each sample (classic PPO: the policy cannot move far from what users get).",
    )
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="Trust region: ratios below 1 - clip_low are clipped.")
    clip_high: float = Field(0.28, gt=0.0, description="Trust region: ratios above 1 + clip_high are clipped "
                             "(DAPO's clip-higher; GSPO's sequence ratios want about 4e-4).")
    is_mode: Literal["tis", "mask"] = Field("tis", description="Truncated or masked importance sampling.")
    is_threshold: float = Field(2.0, ge=1.0, description="Truncation / mask threshold of pi/mu.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of KL(pi || reference) per token; 0 disables it.")
    kl_reference: Literal["parent", "stable"] = Field(
        "parent", description="The KL's reference: each version's parent (a brake on each step), or the stable "
        "version users get (GRPO's reference policy: an anchor to what was verified).")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the policy's entropy per token, "
                                "subtracted from the loss (an exploration bonus); 0 disables it.")
    group_advantage: Literal["grpo", "dr_grpo"] = Field(
        "grpo", description="A grouped completion's advantage (`learner/rl.py: group_advantages`): its reward "
        "minus its group's mean over the group's std (GRPO), or not divided (Dr. GRPO).")
    drop_uniform_groups: bool = Field(
        False, description="Drop a complete group to be trained whose rewards are all equal (DAPO's dynamic "
        "sampling): its advantages are all 0, so it would fill a version's batch with nothing to learn.")
    baseline_by: Literal["tenant", "prompt_end"] = Field(
        "tenant", description="What a lone completion's running reward baseline is kept per: its tenant, or "
        "its tenant and its prompt's last two tokens (a crude value of the kind of prompt it answers).")
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="Adam learning rate on the fp32 master weights "
                      "(with target_kl: the first version's).")
    target_kl: float | None = Field(None, gt=0.0, description="Adaptive step size: after each version the lr "
                                    "is multiplied by 1.5 when its KL from its parent was under half this, "
                                    "divided by 1.5 when over twice this (`learner/rl.py: adapted_lr`); "
                                    "None: the lr stays fixed.")
    max_kl_from_parent: float | None = Field(
        None, gt=0.0, description="A version whose KL from its parent passes this is undone and trained again "
        "from its parent at half the lr, up to kl_backtracks times (`learner/rl.py: backtracked`, TRPO's line "
        "search); None: no limit.")
    max_skill_anchor_drop: float | None = Field(
        None, gt=0.0, description="A version that lowered its skill anchor's passed rollout completions (skill_"
        "anchor_samples from the replay buffer) by more than this many nats a token is undone and trained again "
        "at half the lr, as max_kl_from_parent does (`learner/rl.py: backtracked`); None: no limit.")
    skill_check_tasks: int = Field(
        0, ge=0, description="Tasks of the rollout environment's training split the learner solves greedily "
        "after each version (`learner/skill_check.py`); one that solves a smaller share than stable's less "
        "skill_check_margin (or than its parent's, where that is lower) is trained again at half the lr, as "
        "max_kl_from_parent does; 0: no check.")
    skill_check_margin: Fraction = Field(0.02, description="How far under stable's share of the check tasks "
                                         "the versions since stable may fall (skill_check_tasks).")
    kl_backtracks: int = Field(3, ge=1, description="Most times one version is trained again at half the lr "
                               "(max_kl_from_parent, max_skill_anchor_drop, skill_check_tasks).")
    lr_warmup_updates: int = Field(0, ge=0, description="Optimizer updates over which the lr rises linearly to "
                                   "its whole from 1/N of it (`learner/rl.py: warmup_share`), counted by Adam's own "
                                   "state, so a restart or a rewind resumes the count; 0: no warmup.")
    lr_min: float = Field(1e-5, gt=0.0, le=1.0, description="Smallest lr the adaptive step size goes to.")
    lr_max: float = Field(1e-3, gt=0.0, le=1.0, description="Largest lr the adaptive step size goes to.")
    lora: LoraConfig | None = Field(None, description="Train low-rank adapters on a frozen base instead of "
                                   "the weights themselves (None: full weights, less `frozen_parameters`).")
    frozen_parameters: list[str] = Field(
        default_factory=list, description="Weights kept as the starter has them: those whose names contain "
        "any of these (e.g. embed_tokens, lm_head: the update then changes how the policy uses each token, "
        "not how much it favours it). Empty: every weight trains.",
    )
    minibatch: int = Field(
        16, ge=1, description="Sequences per gradient step (more when a batch needs more steps than the next allows).",
    )
    max_steps_per_version: int = Field(
        6, ge=1, description="Most gradient steps one version takes, so the policy drifts a bounded "
        "amount from the versions that served its samples; a bigger batch gets bigger minibatches.",
    )
    epochs: int = Field(1, ge=1, description="Passes over a version's batch.")
    router_replay: bool = Field(True, description="Force served routing where trajectories carry it.")
    excluded_tenants: list[str] = Field(
        default_factory=list, description="Tenants whose data never trains (still stored and reported)."
    )
    holdout_fraction: Fraction = Field(0.15, description="Share of samples kept out of training for the gate.")
    gate_margin: float = Field(0.05, ge=0.0, description="How far below zero the 95% lower bound of candidate "
                               "minus parent (on the same held-out samples) may be.")
    gate_min_ess: float = Field(8.0, ge=0.0, description="Fewest effective held-out samples for a verdict.")
    gate_clip: float = Field(2.0, ge=1.0, description="Clip of the per-token geometric-mean sequence weight.")
    gate_max_kl: float | None = Field(None, gt=0, description="Ceiling on the mean per-token KL(stable || "
                                      "candidate) on held-out logged samples; None: measured, not enforced.")
    gate_kl_samples: int = Field(32, ge=0, description="Newest held-out samples the KL from stable is measured "
                                 "on (0: not measured).")
    threads: int = Field(1, ge=1, description="torch CPU threads of the learner (of each rank).")
    ranks: int = Field(1, ge=1, description="Processes the learner trains on (torchrun, FSDP2 over gloo): "
                       "weights, gradients and Adam state split between them, rank 0 consuming; 1: one process.")
    probe_tolerance: float = Field(
        1e-4, gt=0.0, description="Max |replica - trainer| logprob on the probe set after a swap, for a "
        "replica computing in fp32 (right weights read <= 4.8e-6, the previous version >= 0.70).")
    probe_tolerance_16bit: float = Field(
        0.5, gt=0.0, description="The same for a replica computing in bfloat16/float16: right weights read "
        "0.049 (starter) to 0.347 (a version trained in the test suite) against the fp32 probe, so at 16 bits the "
        "probe proves the lineage and dtype, not the step (docs/benchmarks.md, The swap's tolerance); the staged "
        "weights' digest does.")

    def probe_tolerance_for(self, dtype: str) -> float:
        """The probe's tolerance for a replica computing in `dtype` (vLLM's --dtype names)."""
        sixteen_bit = dtype in ("bfloat16", "float16", "half")
        return self.probe_tolerance_16bit if sixteen_bit else self.probe_tolerance


class PromotionConfig(Config):
    """The promotion controller (`promotion/controller.py`) and its live canary guard."""

    auto_promote: bool = Field(False, description="Take candidates that pass the offline check to canary, "
                               "and canaries the guard finds non-inferior to stable.")
    canary_guard: bool = Field(True, description="Judge a canary on live feedback against stable before it "
                               "reaches every replica (needs two replicas); off: the offline gate alone.")
    poll_s: float = Field(1.0, gt=0, description="How often the controller looks at the registry and the figures.")
    false_abort_rate: float = Field(0.05, gt=0, lt=0.5, description="Level of the always-valid test: the chance "
                                    "of ever calling a canary no worse than stable worse.")
    false_promotion_rate: float = Field(0.05, gt=0, lt=0.5, description="Level of the one-sided always-valid "
                                        "lower bound a canary clears to be promoted: the chance of ever promoting "
                                        "one more than the margin worse on a metric (each metric at this level: "
                                        "promotion needs them all).")
    mixture_sd: float = Field(0.1, gt=0, description="Spread of the mSPRT's normal mixture over the difference: "
                              "about the smallest difference worth detecting quickly.")
    margin: Fraction = Field(0.05, description="Non-inferiority margin on the accept rate: a canary whose "
                             "interval is above -margin is promoted.")
    reward_margin: float = Field(0.1, ge=0, description="Non-inferiority margin on the mean reward.")
    min_samples: int = Field(50, ge=10, description="Judged completions per arm before any verdict.")
    canary_refresh_samples: int = Field(400, ge=10, description="Canary completions after which an undecided "
                                        "canary gives its place to a newer candidate that passed the gate (sooner "
                                        "if, at the rate its interval narrows, it would still be undecided then).")
    max_samples: int = Field(3000, ge=10, description="Canary completions after which an undecided canary "
                             "is aborted as inconclusive.")
    max_canary_s: float = Field(900.0, gt=0, description="Seconds after which an undecided canary is aborted "
                                "as inconclusive (stable stays).")
    quiet_canary_s: float | None = Field(None, gt=0, description="A canary whose production traffic stayed quiet "
                                         "(see quiet_requests_per_s) this long stands down (superseded, stable "
                                         "back everywhere, no rewind) and none starts until traffic returns, so "
                                         "a trough is not spent on a canary nobody judges; None: canaries wait "
                                         "through it.")
    quiet_requests_per_s: float = Field(0.0, ge=0, description="Production requests per second at or below which "
                                        "traffic is too thin to judge a canary on: no canary starts (nor takes a "
                                        "replica back from rollouts), and with quiet_canary_s a running one "
                                        "stands down; 0: only no traffic at all is quiet.")
    judge_after_s: float | None = Field(None, ge=0, description="A completion counts once this long after it "
                                        "was served (late feedback has arrived); None: the reward window.")
    slide_lookback: int = Field(5, ge=1, description="Recent stable versions the slide guard compares stable "
                                "with (retention keeps their weights); the held-out watch, the most recent this "
                                "many the evaluator scored.")
    slide_margin: Fraction = Field(0.1, description="Stable is rolled back to the best recent stable when its "
                                   "accept rate is surely more than this below that version's.")
    slide_min_samples: int = Field(200, ge=10, description="Judged completions of each before the slide guard "
                                   "compares two stables.")
    heldout_watch: bool = Field(True, description="Alert (`heldout_regression`) when a stable version's "
                                "held-out pass rate (the evaluator's: rollouts.heldout_every_s) is surely more than "
                                "heldout_margin below the best of the slide_lookback scored before it, on the same "
                                "tasks: production feedback training away a skill rollouts taught, which the canary "
                                "guard (production only) cannot see.")
    heldout_margin: Fraction = Field(0.05, description="How far a stable version's held-out pass rate may fall "
                                     "below the best earlier one's before the held-out watch alerts.")
    skill_guard: bool = Field(True, description="Before its canary, judge a candidate on each held-out evaluation "
                              "(the evaluator's: rollouts.heldout_every_s) against the starter and stable "
                              "(skill_reference), task by task; one that surely lost skill is held (rejected, the "
                              "learner rewinds).")
    skill_reference: Literal["stable", "best_recent"] = Field(
        "stable", description="What else the skill guard judges a candidate against, beside the starter: stable, or "
        "the best of the last slide_lookback stables (the held-out watch's reference; a skill given back a step at a "
        "time is held too, at production's pace).")
    skill_rewind: Literal["stable", "last_passed"] = Field(
        "stable", description="Where the learner goes back to after a candidate is held for skill: stable, or the "
        "candidate's nearest ancestor since stable that passed the skill guard (what it learned of production on the "
        "way is kept, but with less of the margin left: docs/learning.md).")
    skill_margin: Fraction = Field(0.05, description="How far a candidate's held-out pass rate may fall below the "
                                   "starter's or its other reference's before the skill guard may hold it.")
    skill_false_hold_rate: float = Field(0.05, gt=0, lt=0.5, description="Level of the skill guard's exact sign "
                                         "test against each reference: the chance of holding a candidate that "
                                         "lost nothing to it.")
    tenant_min_samples: int = Field(100, ge=10, description="Judged completions per arm before one tenant's "
                                    "traffic is compared on its own (fewer: it counts in the total only).")
    error_check: bool = Field(True, description="A canary whose server-error rate is surely above stable's "
                              "(the same always-valid test) is worse.")
    latency_p99_ratio: float | None = Field(1.5, gt=1, description="A canary whose p99 latency is more than this "
                                            "times stable's is worse; None: latency not checked.")
    latency_min_requests: int = Field(200, ge=10, description="Answers of each version before their p99 "
                                      "latencies are compared.")
    tenant_worse: Literal["abort", "hold"] = Field(
        "abort", description="A canary clearly worse for one tenant with enough traffic, though not overall: "
        "abort it, or hold it in canary (never promoted) and ask a human.")
    alert_webhook: HttpUrl | None = Field(None, description="Where the controller POSTs an alert (JSON, "
                                          "docs/production.md) on every automatic abort or rollback and every "
                                          "canary that needs a human; None: logs only.")
    alert_timeout_s: float = Field(5.0, gt=0, description="How long one alert may take to deliver.")
    dashboard_session_s: float = Field(12 * 3600, gt=0, description="How long a dashboard login lasts before "
                                       "the admin key is asked for again.")

    @model_validator(mode="after")
    def _samples(self):
        if self.min_samples > self.max_samples:
            raise ValueError(f"LIVERL_PROMOTION__MIN_SAMPLES ({self.min_samples}) must not exceed "
                             f"LIVERL_PROMOTION__MAX_SAMPLES ({self.max_samples})")
        return self


class SupervisorConfig(Config):
    """How `liverl up` keeps its components running (app/supervisor.py)."""

    enabled: bool = Field(True, description="Restart a component that dies; off: a dead one stays dead.")
    poll_s: float = Field(0.5, gt=0, description="How often the supervisor looks for dead components.")
    backoff_s: float = Field(1.0, gt=0, description="Wait before the first restart; doubled for each death "
                             "within window_s.")
    max_backoff_s: float = Field(30.0, gt=0, description="Longest wait between restarts.")
    max_restarts: int = Field(5, ge=1, description="Deaths within window_s after which a component is left "
                              "down and on-call is alerted, rather than restarted in a loop.")
    window_s: float = Field(600.0, gt=0, description="How far back deaths count towards max_restarts.")
    health_every_s: float = Field(5.0, gt=0, description="How often a live component's health check is asked.")
    unhealthy_after_s: float = Field(30.0, gt=0, description="A live component whose health check has failed "
                                     "this long (after start_timeout_s of grace from its start) is stopped, then "
                                     "restarted as a death: a process alive but stuck serves no one.")
    backlog_every_s: float = Field(10.0, gt=0, description="How often the stream's and the sink's backlog (lag "
                                   "and the age of the oldest event waiting) is measured for status and alerts.")
    backlog_alert_s: float = Field(300.0, gt=0, description="Alert backlog_old when the oldest event the stream "
                                   "or the sink has not processed was produced longer ago than this.")
    backlog_stall_s: float = Field(120.0, gt=0, description="Restart the stream or the sink when it has events "
                                   "waiting and has committed nothing for this long (a consumer stuck in a process "
                                   "whose health page still answers).")


class CapacityConfig(Config):
    """The capacity scheduler (`serving/capacity.py`): idle replicas lent to rollouts."""

    enabled: bool = Field(False, description="Lend idle replicas to rollouts (and start the rollout worker).")
    poll_s: float = Field(0.1, gt=0, description="How often the scheduler reads the gateway's load.")
    lend_below: float = Field(0.5, ge=0, description="Production requests in flight (and waiting) per "
                              "production replica below which the load is low enough to lend one.")
    lend_after_s: float = Field(20.0, ge=0, description="How long the load must stay that low before a "
                                "replica is lent (and between two lends).")
    take_back_above: float = Field(1.0, ge=0, description="Load per production replica above which a lent "
                                   "replica is taken back at once; above lend_below, so it does not flap.")
    lend_below_tokens_per_s: float | None = Field(None, ge=0, description="Also lend only while production "
                                                  "answers fewer completion tokens per second per production "
                                                  "replica than this (long generations are load too); None: "
                                                  "requests alone decide.")
    take_back_bound_s: float = Field(2.0, gt=0, description="The longest a take-back may take, from the last "
                                     "load reading that did not ask for it to production on the replica; one "
                                     "over it is logged as a warning and counted.")
    min_production_replicas: int = Field(1, ge=1, description="Replicas never lent, whatever the load.")
    retry_s: float = Field(10.0, gt=0, description="After a take-back whose swap back to stable failed (the "
                           "replica stays out of production), or a lent replica's staging of stable, how "
                           "long before it is tried again.")
    refresh: Literal["timer", "between_groups"] = Field("timer", description="How a lent replica follows the "
                                                       "learner's newest version: `timer`, every refresh_s, its "
                                                       "groups still running after serving.swap_drain_s cut; "
                                                       "`between_groups`, no group starts there once a newer "
                                                       "version exists and it moves when its last one ends "
                                                       "(each version's groups sampled from its parent, none cut).")
    refresh_s: float = Field(30.0, gt=0, description="With refresh=timer: how often a lent replica moves to the "
                             "learner's newest version, so rollouts stay on-policy.")

    @model_validator(mode="after")
    def _hysteresis(self):
        if self.take_back_above < self.lend_below:
            raise ValueError(f"LIVERL_CAPACITY__TAKE_BACK_ABOVE ({self.take_back_above}) must not be below "
                             f"LIVERL_CAPACITY__LEND_BELOW ({self.lend_below})")
        return self


class RolloutsConfig(Config):
    """Rollout workers (`rollouts/worker.py`): GRPO groups on replicas lent to rollouts."""

    environment: str = Field("coding", description="A built-in environment (coding, coding-feedback, humaneval) or "
                             "'module:Class' of a team's own (rollouts/environment.py).")
    levels: list[int] | None = Field(None, description="Coding environments: the levels tasks are drawn "
                                     "from; None: all.")
    train_params: Literal["split", "wide"] = Field("split", description="Coding environments: parameter names "
                                                   "of training tasks: the split's twelve, or those and 164 "
                                                   "more identifiers (rollouts/coding.py: WIDE_PARAMS), never a "
                                                   "held-out name.")
    group_size: int = Field(16, ge=2, le=1024, description="Completions sampled per task (G): their "
                            "rewards relative to each other are the GRPO advantages.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts.")
    max_tokens: int = Field(24, ge=1, description="Most tokens one rollout completion may take.")
    tenant: str = Field("rollouts", pattern=r"^[A-Za-z0-9._\-]+$", description="The tenant rollouts are "
                        "recorded under (kept apart from production in every table).")
    scoring_threads: int = Field(4, ge=1, description="Completions scored at once in the sandbox.")
    nice: int = Field(10, ge=0, le=19, description="CPU niceness of the rollout worker and its sandboxes (of "
                      "its whole session, where the kernel schedules sessions as groups): on shared cores, "
                      "production and the take-back that returns a replica to it answer first.")
    groups_in_flight: int = Field(2, ge=1, le=64, description="Groups a lent replica works on at once: while "
                                  "one is scored, the next is sampled.")
    context_tokens: int | None = Field(None, ge=16, description="Multi-turn environments: the longest context "
                                       "an episode keeps before the policy summarises it; None: the replicas' "
                                       "serving.max_model_len (more is refused).")
    summary_tokens: int = Field(24, ge=1, description="Multi-turn environments: most tokens of one summary.")
    heldout_every_s: float | None = Field(None, gt=0, description="While rollouts run, how often the learner's "
                                          "newest version is evaluated greedily on the environment's held-out "
                                          "tasks, at the lowest CPU priority, into its metrics (`heldout`); "
                                          "None: no evaluator. It runs the policy with transformers on one CPU "
                                          "thread: for small policies such as the embedded starter (the demo's "
                                          "day sets 60 s).")
    heldout_tasks: int = Field(50, ge=1, description="Held-out tasks each evaluation scores (the same ones "
                               "every time).")
    heldout_poll_s: float = Field(1.0, gt=0, description="How often the evaluator looks for a candidate the "
                                  "promotion controller's skill guard waits on (scored before its canary).")
    heldout_nice: int = Field(19, ge=0, le=19, description="CPU niceness the evaluator runs at (it sets its own "
                              "where allowed): 19 leaves it what no one else wants, which on busy cores holds every "
                              "canary waiting for a skill verdict.")


CONFIG_FILE_VARIABLE = "LIVERL_CONFIG_FILE"


class ConfigFileError(ValueError):
    """The file `LIVERL_CONFIG_FILE` names is missing or is not TOML."""


def config_file_source(settings_cls: type[BaseSettings]) -> TomlConfigSettingsSource:
    """The deployment's TOML file, if `LIVERL_CONFIG_FILE` names one (it must exist)."""
    path = os.environ.get(CONFIG_FILE_VARIABLE)
    if path and not Path(path).is_file():
        raise ConfigFileError(f"{CONFIG_FILE_VARIABLE}={path!r}: no such file")
    try:
        return TomlConfigSettingsSource(settings_cls, toml_file=Path(path) if path else None)
    except ValueError as error:  # tomllib's decode error
        raise ConfigFileError(f"{CONFIG_FILE_VARIABLE}={path!r}: not valid TOML: {error}") from None


class Settings(BaseSettings):
    """liverl's settings. Environment: `LIVERL_<FIELD>`, nested with `__` (`null` turns an
    optional field off); below it, the TOML file named by `LIVERL_CONFIG_FILE`."""

    model_config = SettingsConfigDict(env_prefix="LIVERL_", env_nested_delimiter="__", env_parse_none_str="null",
                                      extra="forbid", validate_assignment=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        return (init_settings, env_settings, dotenv_settings, file_secret_settings,
                config_file_source(settings_cls))

    data_dir: Path = Field(REPO_ROOT / ".liverl", description="Where all state lives.")
    host: str = Field("127.0.0.1", description="Interface every component binds to.")
    ports: PortsConfig = Field(default_factory=PortsConfig, description="Component ports.")
    broker: BrokerConfig = Field(default_factory=EmbeddedBroker, description="Kafka broker.")
    warehouse: WarehouseConfig = Field(
        default_factory=ChdbWarehouse, description="ClickHouse backend."
    )
    delta_store: DeltaStoreConfig = Field(
        default_factory=LocalDeltaStore, description="Where policy deltas are shipped."
    )
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Delta transport to the replicas.")
    starter: StarterPolicyConfig = Field(
        default_factory=StarterPolicyConfig, description="The starter policy."
    )
    serving: ServingConfig = Field(default_factory=ServingConfig, description="vLLM replicas.")
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig, description="Reward join.")
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="Ingest API limits.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The learner.")
    promotion: PromotionConfig = Field(default_factory=PromotionConfig, description="The promotion controller.")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig, description="Lending idle replicas.")
    rollouts: RolloutsConfig = Field(default_factory=RolloutsConfig, description="Off-peak rollouts.")
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig, description="Restarting what dies.")
    broker_cluster_id: str | None = Field(
        None, description="Set by `liverl up`: the embedded broker's (kept with its topics on disk, new "
        "with each memory broker); offsets are recorded with it."
    )
    start_timeout_s: float = Field(90.0, gt=0, description="How long a non-replica component may take.")
    stream_nice: int = Field(
        10, ge=0, le=19, description="Niceness of the feedback stream and the sink: on a shared "
        "machine, ingest and serving answer first and the stream catches up in the gaps.",
    )
    stream_cpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="CPUs the feedback stream and the sink may run on (None: any), so "
        "ingest and serving keep the others to themselves on a shared machine.",
    )
    drain_timeout_s: float = Field(120.0, gt=0, description="How long `down` waits for draining.")

    @model_validator(mode="after")
    def _distinct_ports(self) -> Settings:
        """Every listening port belongs to one component (replicas take base .. base+n-1)."""
        ports = self.ports
        claims = {f"LIVERL_PORTS__{name.upper()}": getattr(ports, name)
                  for name in ("api", "gateway", "sink", "feedback", "learner", "controller", "supervisor")}
        claims |= {f"stream worker {i} (LIVERL_PORTS__FEEDBACK + {i})": ports.feedback + i
                   for i in range(1, self.feedback.workers)}
        if self.serving.listen == "tcp":
            claims |= {f"replica {i} (LIVERL_PORTS__REPLICA_BASE + {i})": ports.replica_base + i
                       for i in range(self.serving.replicas)}
        if isinstance(self.broker, EmbeddedBroker):
            claims["LIVERL_BROKER__PORT"] = self.broker.port
            if self.broker.storage == "disk":
                claims["LIVERL_BROKER__STORE_PORT"] = self.broker.effective_store_port
        owner: dict[int, str] = {}
        for name, port in claims.items():
            if port > 65535:
                raise ValueError(f"{name} is {port}, past the last port 65535")
            if port in owner:
                raise ValueError(f"{name} and {owner[port]} are both port {port}")
            owner[port] = name
        return self

    def public_json(self) -> str:
        """The settings without their secrets, for the running stack's settings file:
        whoever reads them back gets each secret from its own environment."""
        return self.model_dump_json(indent=2, exclude=SECRET_FIELDS)

    def environment(self) -> dict[str, str]:
        """These settings, secrets included, as `LIVERL_*` variables for a child process."""
        return {f"LIVERL_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
                for name, value in self.model_dump(mode="json", context={"secrets": True}).items()}

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap

    @property
    def run_dir(self) -> Path:
        """Pids, logs and the stack manifest of the running stack."""
        return self.data_dir / "run"

    @property
    def keys_file(self) -> Path:
        return self.data_dir / "keys.json"

    @property
    def audit_file(self) -> Path:
        """The append-only log of every admin action (liverl.audit)."""
        return self.data_dir / "audit.db"

    @property
    def dev_keys_file(self) -> Path:
        """The development tenant and admin keys in plaintext, 0600, written by `liverl up`."""
        return self.data_dir / "dev-keys.json"

    @property
    def policies_dir(self) -> Path:
        return self.data_dir / "policies"


def describe_error(error: ValidationError) -> str:
    """One line naming each bad setting as the `LIVERL_*` variable that sets it."""
    union_tags = {"embedded", "kafka", "chdb", "server", "local", "s3"}
    problems = []
    for e in error.errors():
        path = [str(p) for i, p in enumerate(e["loc"]) if not (i == 1 and p in union_tags)]
        message = e["msg"].removeprefix("Value error, ")
        if path and e["type"] != "value_error":
            name = "LIVERL_" + "__".join(p.upper() for p in path)
            problems.append(f"{name}={e['input']!r}: {message}")
        else:  # a rule across fields names its fields itself
            problems.append(message)
    return "invalid settings: " + "; ".join(problems)


class _Defaults(PydanticBaseSettingsSource):
    """A source below the environment: other defaults for some fields."""

    def __init__(self, settings_cls: type[BaseSettings], defaults: dict):
        super().__init__(settings_cls)
        self.defaults = defaults

    def get_field_value(self, field, field_name):  # required by the base class; unused
        return None, field_name, False

    def __call__(self) -> dict:
        return self.defaults


def settings_with_defaults(defaults: dict, **values) -> Settings:
    """Settings whose defaults for some fields are `defaults` (nested dicts): `LIVERL_*`
    variables still override them and `values` override both, all validated."""

    class WithDefaults(Settings):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                       dotenv_settings, file_secret_settings):
            return (init_settings, env_settings, dotenv_settings, file_secret_settings,
                    config_file_source(settings_cls), _Defaults(settings_cls, defaults))

    return WithDefaults(**values)


@lru_cache
def get_settings() -> Settings:
    return Settings()
