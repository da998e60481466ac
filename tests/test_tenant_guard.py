"""A canary fine on average but clearly worse for one tenant with enough traffic never
reaches stable: aborted (or held in canary, as configured), the tenant named with its
figures in the version's history."""

from __future__ import annotations

import shutil
import time

import pytest

from liverl.settings import PromotionConfig, Settings
from policies.registry import Registry
from promotion.controller import Controller, Figures


def judged(version: str, tenant: str, n: int, accepted: int) -> dict:
    return {"policy_version": version, "tenant": tenant, "samples": n, "judged": n, "accepted": accepted,
            "reward_sum": float(accepted), "reward_squares": float(accepted)}


@pytest.mark.parametrize("mode", ["abort", "hold"])
def test_a_canary_clearly_worse_for_one_tenant_never_reaches_stable(tmp_path, starter_dir, mode):
    settings = Settings(data_dir=tmp_path, promotion=PromotionConfig(
        auto_promote=True, judge_after_s=0, tenant_min_samples=100, tenant_worse=mode))
    registry = Registry(settings.policies_dir)
    versions = []
    for state in ("stable", "candidate"):
        staged = tmp_path / f"staged-{state}"
        shutil.copytree(starter_dir, staged)
        versions.append(registry.publish(staged, parent=versions[-1] if versions else None, window=None,
                                         metrics={}, sample_ids=[], actor="test", state=state).version)
    stable, canary = versions
    registry.transition(canary, "canary", "controller", "offline gate passed")
    registry.update_metrics(canary, canary={"started_at": time.time() - 60, "stable": stable})
    # What the sink's /figures would answer (its real answer is exercised by the guard's
    # stack test): acme accepts 60% of stable and 20% of the canary; globex, ten times
    # busier, a little more of the canary, so the canary is better on average.
    rows = [judged(stable, "acme", 400, 240), judged(canary, "acme", 400, 80),
            judged(stable, "globex", 4000, 2000), judged(canary, "globex", 4000, 2300)]
    controller = Controller(settings)
    controller.figures = lambda versions, since, until: Figures(rows)
    controller.serving_figures = lambda versions, since, until: {}  # no answers recorded: nothing to check
    overall = controller.compare(Figures(rows), stable, canary)
    assert all(c.decision == "non_inferior" for c in overall)  # fine on average

    controller.judge(registry.get(canary))

    record = registry.get(canary)
    assert registry.stable().version == stable
    assert record.metrics["canary"]["verdict"] == ("worse" if mode == "abort" else "held")
    named = [c for c in record.metrics["canary"]["tenants"] if c["decision"] == "worse"]
    assert [c["metric"] for c in named] == ["accept_rate[acme]"]
    if mode == "abort":
        assert record.state == "aborted"
        reason = registry.history(canary)[-1]["reason"]
        assert "accept_rate[acme] 0.200 vs 0.600" in reason
    else:
        assert record.state == "canary" and "acme" in controller.state and "held" in controller.state
        controller.judge(registry.get(canary))  # looked at again: still held, never promoted
        assert registry.get(canary).state == "canary"
        held = [h for h in registry.history(canary) if h["to"] == "held"]  # asked once, naming the tenant
        assert len(held) == 1 and held[0]["from"] == "canary"
        assert "accept_rate[acme] 0.200 vs 0.600" in held[0]["reason"]


def served(version: str, requests: int, errors: int, p99_ms: float) -> dict:
    return {"policy_version": version, "requests": requests, "errors": errors, "p50_ms": p99_ms / 3, "p99_ms": p99_ms}


@pytest.mark.parametrize("canary_answers, worse", [
    (served("v1", 1000, 2, 900), []),                                    # as good as stable
    (served("v1", 1000, 80, 900), ["success_rate"]),                     # 8% server errors against 0.2%
    (served("v1", 1000, 2, 2000), ["latency_p99_ms"]),                   # p99 more than 1.5x stable's
    (served("v1", 100, 2, 2000), []),                                    # too few answers to compare p99s
])
def test_failing_or_slow_answers_make_a_canary_worse(tmp_path, canary_answers, worse):
    controller = Controller(Settings(data_dir=tmp_path, promotion=PromotionConfig(latency_min_requests=200)))
    checks = controller.serving_checks({"v0": served("v0", 1000, 2, 1000), "v1": canary_answers}, "v0", "v1")
    assert [c.metric for c in checks] == ["success_rate", "latency_p99_ms"]
    assert [c.metric for c in checks if c.decision == "worse"] == worse
    assert controller.serving_checks({"v0": served("v0", 1000, 2, 1000)}, "v0", "v1") == []  # nothing served yet
