"""A batch is validated whole when it can be, item by item when it cannot: either way
each item becomes the same event or the same error (no stack needed)."""

from __future__ import annotations

import json

import pytest
from fastapi import HTTPException
from helpers import item

from ingest.api import validated_items
from ingest.schemas import FeedbackItem, IngestItem, ItemError, to_event
from liverl.contracts import utcnow
from liverl.kafka import encode

BODIES = [
    {"kind": "accept", "completion_id": "cmpl-1"},
    {"kind": "reject", "completion_id": "cmpl-2"},
    {"kind": "thumbs", "completion_id": "cmpl-3", "up": False},
    {"kind": "score", "completion_id": "cmpl-4", "score": 0.25},
    {"kind": "edit", "completion_id": "cmpl-5", "corrected_text": "def f():\n    return 1\n"},
]


def body_of(batch: list[dict]) -> bytes:
    return json.dumps({"batch": batch}).encode()


def as_sent(routed: tuple) -> tuple[str, str, bytes]:
    topic, partition_key, event = routed
    return topic, partition_key, encode(event)


def test_a_plain_feedback_batch_gives_the_events_item_by_item_validation_gives():
    batch = [item(f"evt-{i}", body) for i, body in enumerate(BODIES)]
    received_at = utcnow()
    whole = validated_items(body_of(batch), max_items=100)
    assert all(isinstance(validated, FeedbackItem) for _, _, validated in whole)
    for (item_id, item_type, validated), raw in zip(whole, batch, strict=True):
        one_by_one = IngestItem.model_validate(raw)
        assert (item_id, item_type) == (raw["id"], "feedback")
        assert as_sent(to_event(validated, "acme", received_at)) == as_sent(to_event(one_by_one, "acme", received_at))


def test_one_bad_item_is_reported_on_itself_and_the_rest_still_validate():
    batch = [item("evt-ok", BODIES[0]), item("evt-bad", {"kind": "score", "completion_id": "c", "score": "high"}),
             item("evt-outcome", {"completion_id": "cmpl-9", "name": "tests_passed", "value": 1.0}, type="outcome"),
             {"id": "evt-typo", "type": "feedbak", "timestamp": "2026-11-22T12:00:00Z", "body": {}}]
    results = validated_items(body_of(batch), max_items=100)
    assert [r[:2] for r in results] == [("evt-ok", "feedback"), ("evt-bad", "feedback"),
                                        ("evt-outcome", "outcome"), ("evt-typo", "?")]
    assert isinstance(results[0][2], IngestItem) and isinstance(results[2][2], IngestItem)
    assert isinstance(results[3][2], ItemError) and "batch.3.type" in str(results[3][2])
    with pytest.raises(ItemError, match="body.score"):
        to_event(results[1][2], "acme", utcnow())


@pytest.mark.parametrize("raw, status", [
    (b"{not json", 400),
    (json.dumps({"items": []}).encode(), 422),
    (json.dumps({"batch": [], "extra": 1}).encode(), 422),
    (body_of([item(f"evt-{i}", BODIES[0]) for i in range(3)]), 413),
])
def test_a_body_that_is_not_a_batch_is_refused_whole(raw, status):
    with pytest.raises(HTTPException) as refused:
        validated_items(raw, max_items=2)
    assert refused.value.status_code == status
