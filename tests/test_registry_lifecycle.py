"""A version's state moves only along the lifecycle, and never without a reason: on-call
gets a refusal that says what is allowed instead of a registry in a state no one meant."""

import shutil
import uuid

import pytest

from policies.registry import TRANSITIONS, IllegalTransition, Registry


@pytest.fixture
def registry(tmp_path, starter_dir):
    registry = Registry(tmp_path / "policies")

    def publish(state="candidate"):
        staged = tmp_path / f"staged-{uuid.uuid4().hex}"
        shutil.copytree(starter_dir, staged)
        return registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[],
                                actor="test", state=state).version

    registry.new = publish
    return registry


def test_the_whole_lifecycle_is_recorded_with_actor_and_reason(registry):
    v0, v1 = registry.new("stable"), registry.new()
    registry.transition(v1, "canary", "key-oncall", "offline gate passed")
    registry.transition(v1, "stable", "key-oncall", "canary non-inferior")
    registry.transition(v0, "superseded", "key-oncall", f"replaced by {v1}")
    registry.transition(v1, "rolled_back", "key-oncall", "users complain")
    registry.transition(v0, "stable", "key-oncall", f"rollback from {v1}")
    moves = [(e["from"], e["to"], e["actor"], e["reason"]) for e in registry.history(v1)]
    assert moves[1:] == [("candidate", "canary", "key-oncall", "offline gate passed"),
                         ("canary", "stable", "key-oncall", "canary non-inferior"),
                         ("stable", "rolled_back", "key-oncall", "users complain")]
    assert registry.stable().version == v0


@pytest.mark.parametrize("from_state,to_state", [
    (a, b) for a in TRANSITIONS for b in TRANSITIONS if b not in TRANSITIONS[a]])
def test_every_illegal_move_is_refused_and_says_what_is_allowed(registry, from_state, to_state):
    version = registry.new(from_state)
    with pytest.raises(IllegalTransition) as refused:
        registry.transition(version, to_state, "key-oncall", "because")
    message = str(refused.value)
    assert f"{version} is {from_state}" in message and to_state in message
    assert all(allowed in message for allowed in TRANSITIONS[from_state]) or "final" in message
    assert registry.get(version).state == from_state  # nothing changed
    assert len(registry.history(version)) == 1


@pytest.mark.parametrize("reason", ["", "   "])
def test_a_move_without_a_reason_is_refused(registry, reason):
    version = registry.new()
    with pytest.raises(IllegalTransition, match="a reason is required"):
        registry.transition(version, "canary", "key-oncall", reason)
    assert registry.get(version).state == "candidate"


def test_a_team_alias_moves_with_its_history_and_never_takes_a_lifecycle_name(registry):
    v0, v1 = registry.new("stable"), registry.new()
    registry.move_alias("champion", v0, "key-a", "best so far")
    registry.move_alias("champion", v1, "key-b", "won the bake-off")
    registry.move_alias("challenger", v0, "key-b", "the one to beat")
    assert registry.aliases() == {"champion": v1, "challenger": v0}
    registry.move_alias("challenger", None, "key-b", "bake-off over")
    assert registry.aliases() == {"champion": v1}
    assert [(m.alias, m.version, m.actor, m.reason) for m in registry.alias_moves()][:2] == [
        ("champion", v0, "key-a", "best so far"), ("champion", v1, "key-b", "won the bake-off")]
    for name in ("stable", "canary"):
        with pytest.raises(IllegalTransition, match="moves with the lifecycle"):
            registry.move_alias(name, v1, "key-a", "shortcut")
    with pytest.raises(KeyError, match="v404"):
        registry.move_alias("champion", "v404", "key-a", "typo")
    with pytest.raises(KeyError, match="no alias 'nobody'"):
        registry.move_alias("nobody", None, "key-a", "tidy up")
    with pytest.raises(IllegalTransition, match="reason"):
        registry.move_alias("champion", v0, "key-a", " ")
    assert registry.aliases() == {"champion": v1}
