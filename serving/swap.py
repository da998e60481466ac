"""Putting a policy version into serving: replace, verify, roll out canary first.

vLLM's in-place `reload_weights` on CPU changes outputs even for identical weights
(DESIGN.md; reproduced here: a probe logprob moved from -6.9125 to -6.9137), so the
path that verifies is blue/green per replica: start the new version beside the old
one, check its logprobs on the version's probe set against the trainer's, point the
gateway at it (new requests go there at once), wait for the old one's in-flight
requests to finish, then stop it. No request is dropped; a replica that fails the
probe never takes traffic and the old one keeps serving.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from pydantic import BaseModel

from learner.trainer import PROBE_FILE
from liverl.process import stop_pid, wait_until
from liverl.settings import Settings
from serving.replicas import (
    SERVED_MODEL_NAME,
    Replica,
    ReplicaError,
    launch_replica,
    read_pool,
    wait_replica,
    write_pool,
)


class VerificationFailed(RuntimeError):
    pass


class SwapReport(BaseModel):
    replica: str
    version: str
    ok: bool
    start_s: float = 0.0
    verify_s: float = 0.0
    drain_s: float = 0.0
    max_logprob_diff: float | None = None
    error: str | None = None


def probe_diff(url: str, model_dir: Path) -> float:
    """Max |served - trainer| logprob over the version's probe tokens."""
    probes = json.loads((model_dir / PROBE_FILE).read_text())["probes"]
    worst = 0.0
    for probe in probes:
        response = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": SERVED_MODEL_NAME, "prompt": probe["token_ids"], "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 0})
        response.raise_for_status()
        served = response.json()["choices"][0]["prompt_logprobs"][1:]
        for token, expected, entry in zip(probe["token_ids"][1:], probe["logprobs"], served):
            worst = max(worst, abs(entry[str(token)]["logprob"] - expected))
    return worst


def verify(url: str, model_dir: Path, tolerance: float) -> float:
    diff = probe_diff(url, model_dir)
    if diff > tolerance:
        raise VerificationFailed(f"probe logprobs differ by {diff:.2e} (tolerance {tolerance:.0e})")
    return diff


def in_flight(url: str) -> float:
    """Requests a vLLM replica is running or holding, from its Prometheus metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def spare_port(settings: Settings, replica: Replica) -> int:
    """Blue/green alternates each replica between two ports."""
    index = int(replica.name.rsplit("-", 1)[1])
    blue = settings.ports.replica_base + index
    green = blue + 50
    return green if replica.url.endswith(f":{blue}") else blue


def replace_replica(settings: Settings, name: str, version: str, model_dir: Path) -> SwapReport:
    old = read_pool(settings).get(name)
    report = SwapReport(replica=name, version=version, ok=False)
    started = time.time()
    new, process = launch_replica(settings, name, model_dir, spare_port(settings, old), version)
    try:
        wait_replica(settings, new, process)
        report.start_s = time.time() - started
        t = time.time()
        report.max_logprob_diff = verify(new.url, model_dir, settings.learner.probe_tolerance)
        report.verify_s = time.time() - t
    except (ReplicaError, VerificationFailed, httpx.HTTPError) as error:
        stop_pid(process.pid)
        report.error = str(error)
        return report
    pool = read_pool(settings)
    pool.replicas = [new if r.name == name else r for r in pool.replicas]
    write_pool(settings, pool)
    t = time.time()
    wait_until(lambda: in_flight(old.url) == 0, settings.serving.request_timeout_s)
    report.drain_s = time.time() - t
    if old.pid:
        stop_pid(old.pid)
    report.ok = True
    return report


def roll_out(settings: Settings, version: str, model_dir: Path) -> list[SwapReport]:
    """Canary first: one replica, verified; then the rest. Stops at the first failure."""
    reports = []
    for replica in read_pool(settings).replicas:
        if replica.policy_version == version:
            continue
        report = replace_replica(settings, replica.name, version, model_dir)
        reports.append(report)
        if not report.ok:
            break
    return reports
