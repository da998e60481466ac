"""The contracts between liverl's parts: topic names and event schemas.

Everything that crosses a process boundary is one of these pydantic models, encoded
as JSON. Producers and consumers import them from here; nothing copies them.
"""

from __future__ import annotations

import base64
import io
import math
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import numpy as np
import zstandard
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1
# The outcome a rollout worker reports for each completion: its environment's score in [0, 1].
ROLLOUT_SCORE = "rollout_score"


class Topics:
    """Kafka topics. Keys: completion_id, so one completion stays on one partition."""

    TRAJECTORIES = "liverl.trajectories"
    FEEDBACK = "liverl.feedback"
    SAMPLES = "liverl.samples"
    DEAD_LETTER = "liverl.dead-letter"
    REQUESTS = "liverl.requests"  # failed/served request records for error-rate analytics
    POLICY_VERSIONS = "liverl.policy-versions"  # registry state changes, for analysts
    CAPACITY = "liverl.capacity"  # replicas lent to rollouts and taken back
    # The join's states, per source partition (feedback/stream.py); named as faust named
    # its table's changelog, so a store written before the stream left faust restores.
    COMPLETIONS_CHANGELOG = "liverl-feedback-completions-changelog"

    ALL = (TRAJECTORIES, FEEDBACK, SAMPLES, DEAD_LETTER, REQUESTS, POLICY_VERSIONS, CAPACITY)
    INTERNAL = (COMPLETIONS_CHANGELOG,)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Strict(BaseModel):
    """Unknown fields are errors: a typo must not silently drop a signal. NaN and infinity
    are errors too: JSON cannot carry them, so what the API accepts the stream can read."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")]
# A tenant's name holds no ':', so "<tenant>:<id>" names (sample ids) are unambiguous.
TenantId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")]
# A policy version's name ("v12"). It becomes a directory name on every replica and a key
# in the delta store, so a name read from anywhere is checked against this first.
VersionName = Annotated[str, Field(pattern=r"^v[0-9]{1,9}$")]
# A team's name for a version (champion, challenger...); `stable` and `canary` are the lifecycle's.
AliasName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
# An id prefixed with its tenant (samples): room for a tenant, ':', an Id and a suffix.
ScopedId = Annotated[str, Field(min_length=1, max_length=300, pattern=r"^[A-Za-z0-9._:\-]+$")]


# --- What the gateway records about each completion -------------------------------------
class SamplingParams(Strict):
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    seed: int | None = None


# --- Routed experts: the top-k expert ids inference chose, per token and MoE layer ------
ROUTING_MAX_IDS = 1 << 28  # ids one record may hold (a 128k-token context, 64 layers, top-32)
ROUTING_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "int32": np.int32}


class RoutedExperts(Strict):
    """A [tokens, layers, top_k] array of expert ids, compact: the smallest integer type that
    holds them (uint8 up to 256 experts), C order, zstd-compressed, base64 in JSON.

    Built from a numpy array (`of`), from the `routed_experts` field of vLLM's OpenAI answer
    (base64 of a `.npy`, what `--enable-return-routed-experts` and liverl's CPU capture
    return), or from nested lists (an SDK's); any of them validates into this form."""

    shape: tuple[int, int, int] = Field(description="[tokens, MoE layers, top_k].")
    dtype: Literal["uint8", "uint16", "int32"]
    zstd: str = Field(description="base64 of the zstd-compressed array bytes.")

    @classmethod
    def of(cls, ids: Any) -> RoutedExperts:
        array = np.asarray(ids)
        if array.ndim != 3 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError("routed experts must be a [tokens][layers][k] array of integer expert ids")
        low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
        dtype: Literal["uint8", "uint16", "int32"] = (
            "uint8" if 0 <= low and high < 256 else "uint16" if 0 <= low and high < 65536 else "int32")
        raw = np.ascontiguousarray(array, dtype=ROUTING_DTYPES[dtype]).tobytes()
        return cls(shape=array.shape, dtype=dtype,
                   zstd=base64.b64encode(zstandard.ZstdCompressor(level=3).compress(raw)).decode())

    def array(self) -> np.ndarray:
        """The ids as a read-only [tokens, layers, k] array of the stored type."""
        raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(self.zstd), max_output_size=self.nbytes)
        return np.frombuffer(raw, dtype=ROUTING_DTYPES[self.dtype]).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(ROUTING_DTYPES[self.dtype]).itemsize

    @model_validator(mode="before")
    @classmethod
    def _from_any(cls, value: Any) -> Any:
        if isinstance(value, str):  # vLLM's answer: base64 of np.save's bytes
            try:
                array = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
            except (ValueError, OSError) as error:
                raise ValueError(f"routed experts: not a base64 .npy array ({error})") from None
            return cls.of(array).model_dump()
        if isinstance(value, list):
            return cls.of(value).model_dump()
        return value

    @model_validator(mode="after")
    def _whole(self):
        if any(n < 0 for n in self.shape) or math.prod(self.shape) > ROUTING_MAX_IDS:
            raise ValueError(f"routed experts: shape {list(self.shape)} is negative or holds over "
                             f"{ROUTING_MAX_IDS} ids")
        try:
            self.array()
        except (zstandard.ZstdError, ValueError) as error:
            raise ValueError(f"routed experts: the data is not a {self.dtype} array of shape "
                             f"{list(self.shape)} ({error})") from None
        return self


WRITTEN_ROLES = ("assistant", "summary")  # the turns the policy itself wrote (sampled, trained)


class Turn(Strict):
    """One step of a multi-turn trajectory (agents: tool calls, many turns)."""

    role: Literal["system", "user", "assistant", "tool", "summary"]
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = Field(None, description="The tokens as they stood in the policy's context. "
                                        "A trajectory whose turns all carry them trains turn by turn "
                                        "(learner/segments.py); without them turns are a record only.")
    logprobs: list[float] | None = Field(None, description="Behaviour logprob of each token of an assistant "
                                         "or summary turn.")
    routed_experts: RoutedExperts | None = Field(None, description="The experts inference routed this turn's "
                                                 "tokens to, [tokens][MoE layer][k], from its first token; "
                                                 "tokens past its length (or a turn without it) unknown.")
    # A "summary" turn is the policy compressing its own context to continue past its
    # window; the segment it replaces is recorded so the learner can credit both.
    summarizes_turns: list[int] | None = None


class Trajectory(Strict):
    """A completion served by a policy version: what the learner trains on."""

    event_id: Id
    schema_version: int = SCHEMA_VERSION
    tenant: TenantId
    timestamp: AwareDatetime = Field(default_factory=utcnow)
    completion_id: Id
    group_id: Id | None = Field(None, description="Completions sampled for one prompt.")
    group_size: int | None = Field(None, ge=2, le=1024, description="How many completions the group has: "
                                   "the learner trains it only whole, in one version (rollouts set it).")
    policy_version: str
    replica: str | None = None
    source: Literal["gateway", "sdk", "rollout"] = "gateway"
    prompt_text: str = ""
    completion_text: str = ""
    prompt_token_ids: list[int] = Field(default_factory=list)
    completion_token_ids: list[int] = Field(default_factory=list)
    completion_logprobs: list[float] = Field(
        default_factory=list, description="Behaviour logprob of each sampled token."
    )
    routed_experts: RoutedExperts | None = Field(
        None, description="The experts inference routed prompt + completion tokens to, [token][MoE layer][k] "
        "from the first prompt token (vLLM returns all but the last completion token); None if unknown."
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    finish_reason: str | None = None
    turns: list[Turn] | None = Field(None, description="Multi-turn agent trajectories.")
    latency_ms: float | None = None
    time_to_first_token_ms: float | None = None

    def multi_turn(self) -> bool:
        """Whether it trains from its turns: only if every turn has its token ids. Otherwise
        the turns are a record of the conversation (an SDK may send them so, with ids on the
        policy's turns alone), and it trains as prompt + completion (learner/segments.py)."""
        return bool(self.turns and all(turn.token_ids for turn in self.turns))

    def token_counts(self) -> tuple[int, int]:
        """(tokens read, tokens written): prompt and completion, or over a multi-turn
        trajectory's turns, the policy's own turns written and every other turn read."""
        turns = self.turns
        if turns is None or not self.multi_turn():
            return len(self.prompt_token_ids), len(self.completion_token_ids)
        written = sum(len(t.token_ids or []) for t in turns if t.role in WRITTEN_ROLES)
        return sum(len(t.token_ids or []) for t in turns) - written, written

    @model_validator(mode="after")
    def _sized_groups_are_named(self):
        if self.group_size is not None and self.group_id is None:
            raise ValueError("group_size needs a group_id")
        return self


class Architecture(BaseModel):
    """What a trajectory's ids must fit: the serving policy's vocabulary and experts.
    `layers` counts the MoE layers only (the ones with a router); a dense model has none."""

    vocab_size: int
    layers: int
    experts: int
    top_k: int

    @classmethod
    def of(cls, config) -> Architecture:
        """From an HF config (object or config.json dict) of a causal LM, MoE or dense."""
        def get(name: str) -> Any:
            return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

        # config.json spells the expert count as Mixtral does, the loaded config as Qwen3-MoE.
        experts = get("num_experts") or get("num_local_experts") or 0
        # Qwen2/3-MoE may keep some layers dense: every decoder_sparse_step-th layer not
        # listed in mlp_only_layers has experts (as transformers builds them).
        step, dense = get("decoder_sparse_step") or 1, set(get("mlp_only_layers") or [])
        layers = sum(1 for i in range(get("num_hidden_layers")) if i not in dense and (i + 1) % step == 0)
        return cls(vocab_size=get("vocab_size"), layers=layers if experts else 0,
                   experts=experts, top_k=(get("num_experts_per_tok") or 0) if experts else 0)


def misfit(t: Trajectory, arch: Architecture) -> tuple[str, str] | None:
    """(field, why) when a trajectory's token or expert ids cannot belong to `arch`."""
    for field in ("prompt_token_ids", "completion_token_ids"):
        if not all(0 <= i < arch.vocab_size for i in getattr(t, field)):
            return field, f"token ids must be in [0, {arch.vocab_size})"
    if t.routed_experts is not None:
        return routing_misfit(t.routed_experts, len(t.prompt_token_ids) + len(t.completion_token_ids), arch)
    for i, turn in enumerate(t.turns or []):
        if turn.routed_experts is not None and (bad := routing_misfit(turn.routed_experts,
                                                                      len(turn.token_ids or []), arch)):
            return f"turns.{i}.{bad[0]}", bad[1]
    return None


def routing_misfit(routing: RoutedExperts, tokens: int, arch: Architecture) -> tuple[str, str] | None:
    """(field, why) when routing recorded for `tokens` tokens cannot belong to `arch`."""
    rows, layers, k = routing.shape
    if rows > tokens or layers != arch.layers or k != arch.top_k:
        return "routed_experts", (f"must be [token][{arch.layers} layers][{arch.top_k} experts] "
                                  f"for at most {tokens} tokens")
    ids = routing.array()
    if ids.size and not (0 <= int(ids.min()) and int(ids.max()) < arch.experts):
        return "routed_experts", f"expert ids must be in [0, {arch.experts})"
    return None


class RequestRecord(Strict):
    """Every gateway request, served or failed, for error-rate and latency per version."""

    event_id: Id
    schema_version: int = SCHEMA_VERSION
    tenant: TenantId
    timestamp: AwareDatetime = Field(default_factory=utcnow)
    completion_id: Id | None = None
    policy_version: str | None = None
    replica: str | None = None
    endpoint: str
    status: int
    error: str | None = None
    latency_ms: float
    stream: bool = False


# --- What product teams send ------------------------------------------------------------
def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


class AcceptBody(Strict):
    kind: Literal["accept"] = "accept"
    completion_id: Id


class RejectBody(Strict):
    kind: Literal["reject"] = "reject"
    completion_id: Id


class ThumbsBody(Strict):
    kind: Literal["thumbs"] = "thumbs"
    completion_id: Id
    up: bool


class ScoreBody(Strict):
    kind: Literal["score"] = "score"
    completion_id: Id
    score: float
    min: float = 0.0
    max: float = 1.0

    _finite_score = field_validator("score", "min", "max")(_finite)


class EditBody(Strict):
    kind: Literal["edit"] = "edit"
    completion_id: Id
    corrected_text: str = Field(max_length=64 * 1024)


class OutcomeBody(Strict):
    """A downstream outcome (tests passed, task solved) credited to a completion."""

    kind: Literal["outcome"] = "outcome"
    completion_id: Id
    name: str = Field(min_length=1, max_length=128)
    value: float

    _finite_value = field_validator("value")(_finite)


FeedbackBody = Annotated[
    AcceptBody | RejectBody | ThumbsBody | ScoreBody | EditBody | OutcomeBody,
    Field(discriminator="kind"),
]


class FeedbackEvent(Strict):
    """A feedback or outcome event on the feedback topic, tenant stamped by the API."""

    event_id: Id
    schema_version: int = SCHEMA_VERSION
    tenant: TenantId
    timestamp: AwareDatetime
    received_at: AwareDatetime = Field(default_factory=utcnow)
    body: FeedbackBody


# --- What the feedback stream emits -----------------------------------------------------
class RewardedSample(Strict):
    """A trajectory with its shaped reward: the learner's input."""

    sample_id: ScopedId = Field(description="'<tenant>:<completion_id>': completion ids are the "
                                "tenant's own names; revisions share it.")
    revision: int = Field(0, description="Later feedback re-emits the sample with revision+1.")
    event_id: ScopedId = Field(description="Unique per (sample_id, revision).")
    schema_version: int = SCHEMA_VERSION
    tenant: TenantId
    timestamp: AwareDatetime = Field(default_factory=utcnow)
    reward: float
    reward_source: Literal["feedback", "default", "late"]
    reward_fn_version: str
    feedback_event_ids: list[str] = Field(default_factory=list)
    accepted: bool | None = Field(None, description="True/False for accept-like signals.")
    trajectory: Trajectory


class DeadLetter(Strict):
    event_id: Id
    schema_version: int = SCHEMA_VERSION
    timestamp: AwareDatetime = Field(default_factory=utcnow)
    source_topic: str
    reason: str
    tenant: str | None = None
    payload: str = Field(description="The original message, verbatim.")


class PolicyVersionEvent(Strict):
    """A policy version's state as of one registry change (the registry is the truth)."""

    event_id: Id
    schema_version: int = SCHEMA_VERSION
    timestamp: AwareDatetime = Field(default_factory=utcnow)
    version: str
    parent: str | None
    state: str
    created_at: float
    content_hash: str
    metrics: dict[str, Any] = Field(default_factory=dict)


class CapacityEvent(Strict):
    """A replica lent to rollouts or taken back by the capacity scheduler, and why."""

    event_id: Id = Field(default_factory=lambda: new_id("cap"))
    schema_version: int = SCHEMA_VERSION
    timestamp: AwareDatetime = Field(default_factory=utcnow)
    action: Literal["lend", "take_back"]
    replica: str
    policy_version: str = Field(description="What it serves afterwards: the rollout version, or stable.")
    load: float = Field(description="Production requests in flight and waiting per production replica.")
    tokens_per_s: float | None = Field(None, description="Production completion tokens answered per second "
                                       "(the gateway's window), per production replica.")
    why: str
    seconds: float = Field(description="To the replica's switch from the load reading that asked for it (a "
                           "take-back for load: from the last reading before it that did not, so a lend or "
                           "refresh that delayed the next reading counts).")
    bound_s: float | None = Field(None, description="A take-back: the bound it had (`capacity.take_back_bound_s`).")
    aborted_requests: int | None = Field(None, description="Rollout requests aborted by a take-back.")
    error: str | None = Field(None, description="Why the swap failed (the replica stays out of production).")
    steps: dict[str, float] = Field(default_factory=dict, description="Seconds per step: aborting the rollouts "
                                    "(take-back) and the swap's fetch, decode, drain, load and verification.")
