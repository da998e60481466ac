"""Promotion mechanics: candidate -> canary (one replica, verified) -> stable (every
replica), abort, and rollback. Every change is recorded in the registry with actor and
reason, and announced to ClickHouse's `policy_versions`.

Who decides is elsewhere: the promotion controller (`promotion/controller.py`) for
automatic promotion with its live canary guard, on-call through `liverl policy`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from liverl.contracts import PolicyVersionEvent, Topics
from liverl.kafka import encode, produce_sync
from liverl.observability import log, setup_logging
from liverl.pool import promotion_lock, read_pool, replica_lock, set_aliases
from liverl.settings import Settings
from policies.registry import REJECTED, AliasMove, PolicyVersion, Registry, State

if TYPE_CHECKING:
    from serving.swap import SwapReport

logger = setup_logging("promotion")


def one_change_at_a_time(method):
    """The method holds the promotion lock (`liverl.pool.promotion_lock`) throughout."""
    @functools.wraps(method)
    def locked(self: Promoter, *args, **kwargs):
        with promotion_lock(self.settings):
            return method(self, *args, **kwargs)
    return locked


class Promoter:
    def __init__(self, settings: Settings, registry: Registry):
        self.settings = settings
        self.registry = registry

    def announce(self, version: PolicyVersion) -> None:
        event = PolicyVersionEvent(
            event_id=f"{version.version}:{len(self.registry.history(version.version))}",
            version=version.version, parent=version.parent, state=version.state,
            created_at=version.created_at, content_hash=version.content_hash, metrics=version.metrics)
        try:
            produce_sync(self.settings, Topics.POLICY_VERSIONS, encode(event))
        except Exception as error:  # analytics must not block a promotion
            log(logger, "could not announce version", version=version.version, error=repr(error))

    def transition(self, version: str, state: State, actor: str, reason: str) -> PolicyVersion:
        return self.transitions([(version, state, reason)], actor)

    def transitions(self, moves: list[tuple[str, State, str]], actor: str) -> PolicyVersion:
        """The moves in one registry transaction, each announced; the last version moved."""
        updated = self.registry.transitions(moves, actor)
        for version in updated:
            self.announce(version)
        return updated[-1]

    def weights(self, version: str) -> Path:
        model_dir = Path(self.registry.get(version).model_dir)
        if not model_dir.exists():
            raise ValueError(f"{version}'s weights were removed by retention (sync.keep_versions); "
                             "promote a newer version")
        return model_dir

    @one_change_at_a_time
    def start_canary(self, version: str, actor: str, reason: str) -> PolicyVersion:
        """The version on one replica (verified), beside stable on the others. A replica
        that fails verification is back on its old weights and the version rolled back."""
        from serving.swap import replace_replica

        model_dir = self.weights(version)
        if self.registry.get(version).state != "canary":  # a canary already: finish its swap (a restart)
            self.transition(version, "canary", actor, reason)
        stable = self.registry.stable()
        others = [r for r in read_pool(self.settings).general if r.policy_version != version]
        # A replica still on an earlier canary first: stable keeps serving where it is.
        others.sort(key=lambda r: stable is not None and r.policy_version == stable.version)
        for replica in others:
            with replica_lock(self.settings, replica.name):
                now = read_pool(self.settings).get(replica.name)
                if now.alias is not None or now.policy_version == version:  # lent to rollouts meanwhile
                    continue
                report = replace_replica(self.settings, replica.name, version, model_dir)
            break
        else:  # every replica serves it already (a restart mid-promotion), or none is in production
            return self.registry.get(version)
        self.registry.update_metrics(version, swaps=[report.model_dump()])
        if not report.ok:
            if stable:  # no candidate may continue a rolled-back version (continues_rejected): from stable
                self.registry.request_rewind(stable.version, actor, f"{version}'s canary swap failed")
            return self.transition(version, "rolled_back", actor, f"{report.replica}: {report.error}")
        set_aliases(self.settings, canary=version)  # the gateway gives it serving.canary_share of sessions
        return self.registry.get(version)

    def move_alias(self, alias: str, version: str | None, actor: str, reason: str) -> AliasMove:
        """A team's alias to a version (None removes it), in the registry's history and in
        the pool the gateway routes by (`x-liverl-alias`)."""
        move = self.registry.move_alias(alias, version, actor, reason)
        set_aliases(self.settings, **{alias: version})
        return move

    @one_change_at_a_time
    def finish(self, version: str, actor: str, reason: str, leave_one: bool = False) -> PolicyVersion:
        """From canary to every replica; the previous stable is superseded. `leave_one`: one
        replica still on the previous stable is left for the next canary, which the caller
        starts at once (one swap per promotion instead of two: that replica goes from the
        old stable straight to the next candidate); if it does not, the caller puts stable
        there (`serve_everywhere`)."""
        previous = self.registry.stable()
        reports = self.serve_everywhere(version, leave_one)
        swaps = self.registry.get(version).metrics.get("swaps", [])
        self.registry.update_metrics(version, swaps=swaps + [r.model_dump() for r in reports])
        if failed := [r for r in reports if not r.ok]:
            self.abort(version, actor, f"{failed[0].replica}: {failed[0].error}", state="rolled_back")
            return self.registry.get(version)
        moves: list[tuple[str, State, str]] = [(version, "stable", reason)]
        if previous and previous.version != version:
            moves.insert(0, (previous.version, "superseded", f"replaced by {version}"))
        return self.transitions(moves, actor)

    @one_change_at_a_time
    def serve_everywhere(self, version: str, leave_one: bool = False) -> list[SwapReport]:
        """`version` on every production replica (but one, `leave_one`) and named stable;
        the reports of its swaps.

        A replica the capacity scheduler brings back from rollouts while this runs returns
        on the stable it read: if that was before the alias moved, a second pass (after it)
        swaps the replica too; if after, the scheduler itself swaps it again."""
        from serving.swap import roll_out

        reports = roll_out(self.settings, version, self.weights(version), leave_one)
        if any(not r.ok for r in reports):
            return reports
        set_aliases(self.settings, stable=version, canary=None)
        return reports + roll_out(self.settings, version, self.weights(version), leave_one)

    @one_change_at_a_time
    def promote(self, version: str, actor: str, reason: str = "offline gate passed") -> PolicyVersion:
        """Canary then stable, without waiting for live feedback in between."""
        canary = self.start_canary(version, actor, f"{reason}; rolling out canary first")
        if canary.state != "canary":
            return canary
        return self.finish(version, actor, "every replica verified")

    @one_change_at_a_time
    def abort(self, version: str, actor: str, reason: str, state: State = "aborted") -> PolicyVersion:
        """Every replica serving `version` goes back to stable (verified); the version
        leaves canary for `state`. Aborted or rolled back (a failed swap), the learner is
        asked to continue from stable: the controller takes no candidate built on either."""
        from serving.swap import roll_out

        self.registry.check(version, state, reason)
        stable = self.registry.stable()
        if stable:
            failed = [r for r in roll_out(self.settings, stable.version, self.weights(stable.version)) if not r.ok]
            if failed:
                log(logger, "could not put stable back", version=stable.version, error=failed[0].error)
        # Stable named again: a second pass of `serve_everywhere` that failed had moved it.
        set_aliases(self.settings, canary=None, **({"stable": stable.version} if stable else {}))
        if stable and state in REJECTED:  # before the move: killed in between, a restart aborts again
            self.registry.request_rewind(stable.version, actor, f"{version} aborted: {reason}")
        return self.transition(version, state, actor, reason)

    @one_change_at_a_time
    def rollback(self, actor: str, reason: str, to: str | None = None) -> PolicyVersion:
        """Take the stable version out: `to` (default: the version stable before it)
        serves again on every replica, verified, and the learner continues from it."""
        current = self.registry.stable()
        if current is None:
            raise KeyError("no stable version to roll back")
        if to is None:
            # The last stable before it that was not itself taken off users.
            earlier = [e["version"] for e in self.registry.history() if e["to"] == "stable"
                       and e["version"] != current.version and self.registry.get(e["version"]).state not in REJECTED]
            if not earlier:
                raise KeyError(f"{current.version} is the first stable version; nothing to roll back to")
            to = earlier[-1]
        if to == current.version:
            raise ValueError(f"{to} is stable already; roll back to an earlier version")
        self.registry.check(current.version, "rolled_back", reason)
        self.registry.check(to, "stable", reason)
        failed = [r for r in self.serve_everywhere(to) if not r.ok]
        if failed:
            raise RuntimeError(f"rollback to {to} failed on {failed[0].replica}: {failed[0].error}")
        for canary in self.registry.in_state("canary"):  # its replica went back too; it was built on what failed
            if canary.version != to:
                self.transition(canary.version, "rejected", actor, f"rollback to {to} took every replica")
        restored = self.transitions([(current.version, "rolled_back", reason),
                                     (to, "stable", f"rollback from {current.version}: {reason}")], actor)
        self.registry.request_rewind(to, actor, f"rollback from {current.version}: {reason}")
        return restored
