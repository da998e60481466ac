"""Promotion: candidate -> canary (one replica, verified) -> stable (every replica).

Automatic in demo mode (`learner.auto_promote`) for candidates that pass the offline
gate; manual in production (`liverl policy promote`). Every change is recorded in the
registry with actor and reason, and announced to ClickHouse's `policy_versions`.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from liverl.contracts import PolicyVersionEvent, Topics
from liverl.kafka import encode, produce_sync
from liverl.observability import log, setup_logging
from liverl.settings import Settings
from policies.registry import PolicyVersion, Registry

logger = setup_logging("promotion")


class Promoter:
    def __init__(self, settings: Settings, registry: Registry):
        self.settings = settings
        self.registry = registry
        self._offers: queue.Queue[PolicyVersion | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.busy = threading.Event()
        self.last_error: str | None = None  # the last promotion that failed unexpectedly, for /health

    def announce(self, version: PolicyVersion) -> None:
        event = PolicyVersionEvent(
            event_id=f"{version.version}:{len(self.registry.history(version.version))}",
            version=version.version, parent=version.parent, state=version.state,
            created_at=version.created_at, content_hash=version.content_hash, metrics=version.metrics)
        try:
            produce_sync(self.settings, Topics.POLICY_VERSIONS, encode(event))
        except Exception as error:  # analytics must not block a promotion
            log(logger, "could not announce version", version=version.version, error=repr(error))

    def transition(self, version: str, state: str, actor: str, reason: str) -> PolicyVersion:
        updated = self.registry.transition(version, state, actor, reason)
        self.announce(updated)
        return updated

    def promote(self, version: str, actor: str) -> PolicyVersion:
        """Canary then stable; a replica that fails verification rolls the version back."""
        from serving.swap import roll_out

        target = self.registry.get(version)
        if not Path(target.model_dir).exists():
            raise ValueError(f"{version}'s weights were removed by retention (sync.keep_versions); "
                             "promote a newer version")
        previous = self.registry.stable()
        self.transition(version, "canary", actor, "offline gate passed; rolling out canary first")
        reports = roll_out(self.settings, version, Path(target.model_dir))
        self.registry.update_metrics(version, swaps=[r.model_dump() for r in reports])
        failed = [r for r in reports if not r.ok]
        if failed:
            self.transition(version, "rolled_back", actor, f"{failed[0].replica}: {failed[0].error}")
            if previous:  # replicas already moved go back to the last stable version
                roll_out(self.settings, previous.version, Path(previous.model_dir))
            return self.registry.get(version)
        if previous and previous.version != version:
            self.transition(previous.version, "superseded", actor, f"replaced by {version}")
        return self.transition(version, "stable", actor, "every replica verified")

    def rollback(self, actor: str, reason: str) -> PolicyVersion:
        """Take the stable version out: the version stable before it serves again."""
        from serving.swap import roll_out

        current = self.registry.stable()
        if current is None:
            raise KeyError("no stable version to roll back")
        earlier = [e["version"] for e in self.registry.history()
                   if e["to"] == "stable" and e["version"] != current.version]
        if not earlier:
            raise KeyError(f"{current.version} is the first stable version; nothing to roll back to")
        target = self.registry.get(earlier[-1])
        failed = [r for r in roll_out(self.settings, target.version, Path(target.model_dir)) if not r.ok]
        if failed:
            raise RuntimeError(f"rollback to {target.version} failed on {failed[0].replica}: {failed[0].error}")
        self.transition(current.version, "rolled_back", actor, reason)
        return self.transition(target.version, "stable", actor, f"rollback from {current.version}: {reason}")

    # --- automatic promotion, in the background ------------------------------------------
    def offer(self, version: PolicyVersion) -> None:
        self.announce(version)
        if not self.settings.learner.auto_promote:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="promoter", daemon=True)
            self._thread.start()
        self._offers.put(version)

    def stop(self) -> None:
        if self._thread is not None:
            self._offers.put(None)

    def _run(self) -> None:
        while (offer := self._offers.get()) is not None:
            while not self._offers.empty():  # only the newest candidate is worth a swap
                newer = self._offers.get()
                if newer is None:
                    return
                self.transition(offer.version, "superseded", "promoter", f"{newer.version} is newer")
                offer = newer
            gate = offer.metrics.get("gate")
            if not gate or not gate["passed"]:
                reason = gate["reason"] if gate else "no held-out samples yet"
                log(logger, "candidate waits", version=offer.version, reason=reason)
                continue
            started = time.time()
            self.busy.set()
            try:
                result = self.promote(offer.version, "promoter")
            except Exception as error:  # the promoter survives any one version, and says why
                self.fail(offer.version, f"{type(error).__name__}: {error}")
                continue
            finally:
                self.busy.clear()
            log(logger, "promotion finished", version=offer.version, state=result.state,
                seconds=round(time.time() - started, 1))

    def fail(self, version: str, error: str) -> None:
        """A promotion that raised: recorded on the version, which leaves canary, and
        every replica goes back to the stable version."""
        from serving.swap import roll_out

        self.last_error = f"{version}: {error}"
        log(logger, "promotion failed", version=version, error=error)
        try:
            self.registry.update_metrics(version, promotion_error=error)
            if self.registry.get(version).state == "canary":
                self.transition(version, "rolled_back", "promoter", f"promotion failed: {error}")
            if stable := self.registry.stable():
                roll_out(self.settings, stable.version, Path(stable.model_dir))
        except Exception as again:
            log(logger, "could not restore after a failed promotion", version=version, error=repr(again))
