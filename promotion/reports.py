"""What on-call reads about versions, computed once for both the `liverl policy`
commands and the controller's admin API: two versions side by side, the history of
every move, and which version served a tenant at a given time.

Figures come from ClickHouse through the sink's admin SQL (every query audited there),
lineage and moves from the registry.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import get_args

import httpx
from pydantic import TypeAdapter, ValidationError

from liverl.contracts import TenantId, VersionName
from liverl.keys import admin_headers
from liverl.settings import Settings
from policies.registry import PolicyVersion, Registry, State
from promotion.sequential import wilson

STATES = set(get_args(State))


class ReportError(ValueError):
    """A question asked with a malformed name."""


class SinkError(RuntimeError):
    """ClickHouse, through the sink, could not answer."""


def sink_sql(settings: Settings, sql: str) -> list[dict]:
    """One read-only query as admin (every tenant), through the sink."""
    try:
        response = httpx.post(settings.url(settings.ports.sink) + "/sql", headers=admin_headers(settings),
                              json={"sql": sql, "format": "json"}, timeout=60)
    except httpx.ConnectError:
        raise SinkError("the analytics sink is not reachable; is the stack up (`liverl status`)?") from None
    if response.status_code != 200:
        raise SinkError(response.json().get("detail", response.text))
    return response.json()["data"]


def checked(adapter: type, value: str, what: str) -> str:
    """A name that goes into SQL: only a well-formed one."""
    try:
        return TypeAdapter(adapter).validate_python(value)
    except ValidationError:
        raise ReportError(f"{value!r} is not {what}") from None


# --- diff ------------------------------------------------------------------------------------
DIFF_SQL = """SELECT tenant, policy_version, toInt64(sum(samples)) AS n, sum(reward_sum) AS reward_sum,
    toInt64(sum(accepted)) AS accepted, toInt64(sum(judged)) AS judged
FROM version_hourly WHERE policy_version IN ('{a}', '{b}') GROUP BY tenant, policy_version ORDER BY tenant"""

KL_SQL = """SELECT prompt_text, completion_text FROM trajectories
WHERE policy_version IN ('{a}', '{b}') AND source != 'rollout' ORDER BY timestamp DESC LIMIT {n}"""


def diff(settings: Settings, a: str, b: str, kl_completions: int = 64) -> dict:
    """Two versions side by side: live reward and accept rate per tenant with 95% Wilson
    intervals, the offline gate's estimate and KL from stable, train/inference mismatch,
    the delta size, and the KL between them on logged production completions."""
    from sync.records import read_records, sync_store

    registry = Registry(settings.policies_dir)
    versions = [registry.get(checked(VersionName, name, "a version name")) for name in (a, b)]  # KeyError: unknown
    rows = sink_sql(settings, DIFF_SQL.format(a=a, b=b))
    try:
        records = read_records(sync_store(settings))
    except Exception:  # a store that cannot be read leaves the size blank, not the diff
        records = {}
    figures: dict[str, dict] = {}
    for v in versions:
        gate = v.metrics.get("gate") or {}
        record = records.get(v.version)
        figures[v.version] = {
            "state": v.state, "parent": v.parent,
            "offline_estimate": (gate.get("candidate") or {}).get("value"),
            "offline_ess": (gate.get("candidate") or {}).get("ess"),
            "kl_from_stable_at_gate": gate.get("kl_from_stable"),
            "logprob_mismatch_mean": v.metrics.get("logprob_mismatch_mean"),
            "delta_bytes_from_parent": record.delta.size if record and record.delta else None,
            "tenants": {}}
    for row in rows:
        lo, hi = wilson(row["accepted"], row["judged"])
        figures[row["policy_version"]]["tenants"][row["tenant"]] = {
            "served": row["n"], "mean_reward": row["reward_sum"] / max(row["n"], 1),
            "accept_rate": row["accepted"] / row["judged"] if row["judged"] else None, "accept_ci": [lo, hi]}
    return {"a": a, "b": b, "versions": figures,
            "kl_on_logged": logged_kl(settings, versions[0], versions[1], kl_completions)}


def logged_kl(settings: Settings, a: PolicyVersion, b: PolicyVersion, n: int) -> dict:
    """KL(a || b) on the newest `n` production completions either version served, as the
    users' prompts and the policy's answers were logged (policies/divergence.py)."""
    from transformers import AutoTokenizer

    from policies.divergence import kl_between

    missing = [v.version for v in (a, b) if not (Path(v.model_dir) / "config.json").exists()]
    if missing or n == 0:
        return {"value": None, "completions": 0,
                "why": f"weights of {', '.join(missing)} no longer kept (retention)" if missing else "not asked"}
    rows = sink_sql(settings, KL_SQL.format(a=a.version, b=b.version, n=n))
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    sequences = []
    for row in rows:
        prompt = tokenizer(row["prompt_text"])["input_ids"]
        completion = tokenizer(row["completion_text"], add_special_tokens=False)["input_ids"]
        sequences.append((prompt + completion, len(prompt)))
    value = kl_between(Path(a.model_dir), Path(b.model_dir), sequences)
    return {"value": value, "completions": len(rows), "why": None if rows else "no logged completions yet"}


# --- history ---------------------------------------------------------------------------------
def history(registry: Registry, version: str | None = None) -> list[dict]:
    """Every state change (of one version, or of all with every pin and alias move too),
    oldest first: version, at (Unix time), from, to, actor, reason."""
    rows = registry.history(version)
    if version is None:
        rows += [{"version": p.version, "at": p.at, "from": "", "to": "pinned" if p.pinned else "unpinned",
                  "actor": p.actor, "reason": p.reason} for p in registry.pins()]
        rows += [{"version": m.version, "at": m.at, "from": "",
                  "to": f"alias {m.alias}" if m.version else f"alias {m.alias} removed",
                  "actor": m.actor, "reason": m.reason} for m in registry.alias_moves()]
        rows.sort(key=lambda r: r["at"])
    return rows


SERVED_SQL = """SELECT policy_version, replica, count() AS requests, min(timestamp) AS first, max(timestamp) AS last
FROM requests WHERE tenant = '{tenant}' AND timestamp >= '{since}' AND timestamp <= '{until}'
GROUP BY policy_version, replica ORDER BY first"""


def served_at(settings: Settings, tenant: str, at: datetime, window_s: float = 60.0) -> dict:
    """Which versions answered `tenant` within `window_s` of `at` (ClickHouse's request
    log), and what was stable and canary then (the registry)."""
    checked(TenantId, tenant, "a tenant name (letters, digits, '.', '_', '-')")
    at = at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    since, until = ((at + timedelta(seconds=s)).strftime("%Y-%m-%d %H:%M:%S") for s in (-window_s, window_s))
    served = sink_sql(settings, SERVED_SQL.format(tenant=tenant, since=since, until=until))
    states: dict[str, str] = {}
    for event in Registry(settings.policies_dir).history():
        if event["at"] <= at.timestamp() and event["to"] in STATES:  # not an event such as "held"
            states[event["version"]] = event["to"]
    return {"tenant": tenant, "at": at.isoformat(), "window_s": window_s, "served": served,
            "stable": [v for v, s in states.items() if s == "stable"],
            "canary": [v for v, s in states.items() if s == "canary"]}
