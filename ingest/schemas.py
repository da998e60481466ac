"""The ingestion API's wire format, and how one raw item becomes a contract event.

Items are validated one at a time so one bad item never sinks its batch. The common
batch, feedback only and all of it valid, is first tried whole (`FeedbackBatch`: parsed
and validated in one pass in pydantic-core); anything that fails that goes item by
item, so every error is still reported against its own item.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import AwareDatetime, BaseModel, Field, ValidationError

from liverl.contracts import (
    ROLLOUT_SCORE,
    SCHEMA_VERSION,
    Architecture,
    FeedbackBody,
    FeedbackEvent,
    Id,
    OutcomeBody,
    Strict,
    TenantId,
    Topics,
    Trajectory,
    misfit,
)
from liverl.keys import Role, Scope

# kind -> body model, for errors that name the field ("body.score"), not the union tag.
FEEDBACK_KINDS = {
    model.model_fields["kind"].default: model
    for model in get_args(get_args(FeedbackBody)[0])
    if model is not OutcomeBody
}


class IngestItem(Strict):
    id: Id
    type: Literal["feedback", "trajectory", "outcome"]
    timestamp: AwareDatetime = Field(description="With its timezone, e.g. 2026-11-22T12:00:00Z.")
    body: dict[str, Any]


class FeedbackItem(IngestItem):
    """A feedback item typed down to its body: what most batches hold entirely."""

    type: Literal["feedback"]
    # A union built at run time from FEEDBACK_KINDS: no static checker can evaluate it, and
    # ruff's X | Y rewrite would drop the Union around the tuple.
    body: Annotated[Union[tuple(FEEDBACK_KINDS.values())], Field(discriminator="kind")]  # type: ignore[valid-type]  # noqa: UP007


class FeedbackBatch(Strict):
    batch: list[FeedbackItem]


class KeyRequest(Strict):
    tenant: TenantId
    role: Role = "tenant"
    label: str = Field("", max_length=200)
    scopes: list[Scope] = Field(["feedback"], description="What the key may send.")


class ItemResult(BaseModel):
    id: str | None
    status: int
    duplicate: bool = False
    error: str | None = None


class IngestResponse(BaseModel):
    accepted: int
    rejected: int
    results: list[ItemResult]


class ItemError(ValueError):
    """An item the API refuses, with a message naming the field."""

    status = 400


class ItemForbidden(ItemError):
    """An item the caller's key may not send."""

    status = 403


def describe(error: ValidationError, prefix: str = "") -> str:
    parts = []
    for e in error.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "; ".join(parts)


def to_event(item: IngestItem, tenant: str, received_at: datetime,
             arch: Architecture | None = None) -> tuple[str, str, BaseModel]:
    """(topic, partition key, event) for a validated item; ItemError if its body is bad.
    A trajectory's ids must fit `arch`, the serving policy's architecture."""
    try:
        if isinstance(item, FeedbackItem):
            body = item.body
        elif item.type == "trajectory":
            if {"event_id", "tenant"} & item.body.keys():
                raise ItemError("body: event_id and tenant are set by the API, not the caller")
            trajectory = Trajectory.model_validate(
                {**item.body, "event_id": item.id, "tenant": tenant,
                 "timestamp": item.timestamp, "source": "sdk"}
            )
            if arch is not None and (bad := misfit(trajectory, arch)):
                raise ItemError(f"body.{bad[0]}: {bad[1]}")
            return Topics.TRAJECTORIES, trajectory.completion_id, trajectory
        elif item.type == "outcome":
            body = OutcomeBody.model_validate({"kind": "outcome", **item.body})
            if body.name == ROLLOUT_SCORE:  # counted as reward by default: the rollout worker's alone
                raise ItemError(f"body.name: {ROLLOUT_SCORE} is the rollout worker's score of its own "
                                "rollouts; name the outcome after what it measures")
        else:
            model = FEEDBACK_KINDS.get(item.body.get("kind"))
            if model is None:
                raise ItemError(f"body.kind: must be one of {sorted(FEEDBACK_KINDS)}")
            body = model.model_validate(item.body)
    except ValidationError as error:
        raise ItemError(describe(error, "body")) from None
    # Every field is validated already (the item, the body, the tenant when its key was
    # created): no second pass. Every field is given, defaults too: pydantic inspects a
    # default factory's signature each time it calls it, a sixth of the API's CPU.
    event = FeedbackEvent.model_construct(event_id=item.id, schema_version=SCHEMA_VERSION, tenant=tenant,
                                          timestamp=item.timestamp, received_at=received_at, body=body)
    return Topics.FEEDBACK, body.completion_id, event
