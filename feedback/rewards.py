"""Reward functions that product teams configure per tenant.

A YAML file maps tenants to a `RewardConfig`; its `version` (plus a hash of the whole
config) is stamped on every sample, so a reward change is visible in the data. An
optional Python hook (`module:function`) computes a custom reward from the trajectory
and its feedback.

Several feedback events on one completion: the latest (by its own timestamp) decides,
so a user who accepts and later edits is scored by the edit. Outcomes add to it.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

from liverl.contracts import ROLLOUT_SCORE, FeedbackEvent, OutcomeBody, Trajectory

RewardHook = Callable[[Trajectory, Sequence[FeedbackEvent]], float]



class RewardConfig(BaseModel):
    version: str = Field("default-1", description="Bumped by the team on every change.")
    accept: float = Field(1.0, description="Reward of an accepted completion.")
    reject: float = Field(0.0, description="Reward of a rejected completion.")
    thumbs_up: float = Field(1.0, description="Reward of a thumbs-up.")
    thumbs_down: float = Field(0.0, description="Reward of a thumbs-down.")
    edit_scale: float = Field(
        1.0, description="Reward of an edit = scale x similarity(completion, correction)."
    )
    outcome_weights: dict[str, float] = Field(
        default_factory=dict, description="Added reward per unit of a named outcome."
    )
    default_reward: float | None = Field(
        None, description="Reward when the window closes with no feedback; None: no sample."
    )
    hook: str | None = Field(None, description="Optional 'module:function' custom reward.")


class RewardConfigFile(BaseModel):
    default: RewardConfig = Field(default_factory=RewardConfig)
    tenants: dict[str, RewardConfig] = Field(default_factory=dict)


class RewardResult(BaseModel):
    reward: float
    accepted: bool | None
    fn_version: str


class Rewarder:
    def __init__(self, config: RewardConfigFile):
        self.config = config
        self._hooks: dict[str, RewardHook] = {}
        self._versions: dict[str, str] = {}  # per tenant: the config is fixed for the process's life

    @classmethod
    def from_file(cls, path: Path | None) -> Rewarder:
        if path is None:
            return cls(RewardConfigFile())
        return cls(RewardConfigFile.model_validate(yaml.safe_load(path.read_text()) or {}))

    def for_tenant(self, tenant: str) -> RewardConfig:
        return self.config.tenants.get(tenant, self.config.default)

    def fn_version(self, tenant: str) -> str:
        if tenant not in self._versions:
            config = self.for_tenant(tenant)
            digest = hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:8]
            self._versions[tenant] = f"{config.version}+{digest}"
        return self._versions[tenant]

    def _hook(self, spec: str) -> RewardHook:
        if spec not in self._hooks:
            module, _, name = spec.partition(":")
            self._hooks[spec] = getattr(importlib.import_module(module), name)
        return self._hooks[spec]

    def default(self, trajectory: Trajectory) -> RewardResult | None:
        config = self.for_tenant(trajectory.tenant)
        if config.default_reward is None:
            return None
        return RewardResult(
            reward=config.default_reward, accepted=None, fn_version=self.fn_version(trajectory.tenant)
        )

    def score(self, trajectory: Trajectory, events: Sequence[FeedbackEvent]) -> RewardResult:
        config = self.for_tenant(trajectory.tenant)
        version = self.fn_version(trajectory.tenant)
        if config.hook:
            return RewardResult(
                reward=float(self._hook(config.hook)(trajectory, events)), accepted=None,
                fn_version=version,
            )
        signals = [e for e in events if not isinstance(e.body, OutcomeBody)]
        reward, accepted = 0.0, None
        if signals:
            reward, accepted = signal_reward(max(signals, key=lambda e: e.timestamp), trajectory, config)
        for e in events:
            if isinstance(e.body, OutcomeBody):
                # A rollout's environment score is its reward unless the team weighs it otherwise;
                # on any other trajectory it is nobody's to give (ingest refuses it too).
                own_score = e.body.name == ROLLOUT_SCORE and trajectory.source == "rollout"
                weight = config.outcome_weights.get(e.body.name, 1.0 if own_score else 0.0)
                reward += weight * e.body.value
        return RewardResult(reward=reward, accepted=accepted, fn_version=version)


def signal_reward(
    event: FeedbackEvent, trajectory: Trajectory, config: RewardConfig
) -> tuple[float, bool | None]:
    """(reward, accepted?) of one accept/reject/thumbs/score/edit signal."""
    body = event.body
    match body.kind:
        case "accept":
            return config.accept, True
        case "reject":
            return config.reject, False
        case "thumbs":
            return (config.thumbs_up, True) if body.up else (config.thumbs_down, False)
        case "score":
            # Scaled to [0, 1] by the range the product declared.
            span = (body.max - body.min) or 1.0
            return min(max((body.score - body.min) / span, 0.0), 1.0), None
        case "edit":
            similarity = difflib.SequenceMatcher(
                None, trajectory.completion_text, body.corrected_text
            ).ratio()
            return config.edit_scale * similarity, None
    raise ValueError(f"unknown feedback kind {body.kind!r}")
