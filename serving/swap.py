"""Putting a policy version into serving: swap, verify, roll out canary first.

Two ways, one contract (the replica ends on the new version verified, or on the old
one, never on unverified weights):

- "inplace" (default): vLLM's stock `reload_weights` corrupts MoE experts on CPU
  (docs/inplace-reload.md), so replicas run with our worker extension
  (`serving/inplace.py`) that reloads and re-packs them. The commit: the gateway stops
  sending the replica new requests (they wait or go to another replica), the requests
  it is running finish on the old weights (for up to `serving.swap_drain_s`: a
  completion then comes from one version, and the engine is idle, so the pause is
  short), vLLM pauses keeping whatever is still in flight, the weights load, the
  prefix cache is reset (cached KV came from the old weights), vLLM resumes, the
  version's probe set is checked against the trainer's logprobs, and only then does
  the gateway route to it again. The load is partial: only the tensors whose bytes
  differ from what the replica holds (hashed before the pause), completed to whole vLLM
  modules, so the pause scales with the change (a LoRA step: attention and routers);
  the whole directory when the change covers most of the model or a partial load fails.
  A replica that fails the probe loads its old weights back (whole), is verified again,
  and serves on.
- "restart": blue/green per replica: start the new version beside the old, verify,
  point the gateway at it, let the old one finish its requests, stop it.

With the delta transport (`sync.transport`, the default) the version is first staged
while the replica serves on: rebuilt from the delta store into the replica's own
directory and verified (`sync.replica`); the commit then loads that directory. If
staging fails, the registry's full directory is loaded instead and the report says why.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from liverl.pool import (
    SERVED_MODEL_NAME,
    Replica,
    edit_pool,
    read_pool,
    replica_client,
    replica_lock,
    set_replica,
)
from liverl.probe import PROBE_FILE
from liverl.process import stop_pid, wait_until
from liverl.settings import Settings
from serving.inplace import changed_tensors, tensor_digests
from serving.replicas import launch_replica, replica_url, wait_replica
from sync.replica import ReplicaSync


class VerificationFailed(RuntimeError):
    pass


class SwapReport(BaseModel):
    replica: str
    version: str
    ok: bool
    mode: str
    pause_s: float = Field(0.0, description="Time out of rotation: the replica took no new requests.")
    load_s: float = Field(0.0, description="The serving pause: the engine paused while the weights "
                                           "load (or the new engine starting).")
    start_s: float = 0.0
    verify_s: float = 0.0
    drain_s: float = Field(0.0, description="In-flight requests finishing on the old weights.")
    max_logprob_diff: float | None = None
    reverted: bool = False
    error: str | None = None
    transport: str = Field("full", description="delta: staged from the delta store; full: the registry's directory.")
    fetched_bytes: int = Field(0, description="Bytes fetched from the delta store.")
    weights_bytes: int = Field(0, description="Bytes of the version's tensors, what a full copy would ship.")
    fetch_s: float = Field(0.0, description="Fetching and verifying chunks from the delta store.")
    decode_s: float = Field(0.0, description="Decoding deltas into the replica's directory and verifying it.")
    sync_error: str | None = Field(None, description="Why the delta transport was not used.")
    load_mode: str | None = Field(None, description="partial: only the modules whose tensors changed were "
                                                    "loaded; full: the whole directory.")
    loaded_tensors: int = Field(0, description="Checkpoint tensors loaded into the engine.")
    loaded_bytes: int = Field(0, description="Their bytes.")
    load_fallback: str | None = Field(None, description="Why the load was not partial.")
    diff_s: float = Field(0.0, description="Finding the changed tensors (hashing what was not hashed "
                                           "before the replica left rotation).")


def probe_diff(url: str, model_dir: Path) -> float:
    """Max |served - trainer| logprob over the version's probe tokens; NaN when the
    replica's answer does not cover every probe token (so it cannot pass)."""
    probes = json.loads((model_dir / PROBE_FILE).read_text())["probes"]

    def worst_of(probe: dict) -> float:
        response = http.post("/v1/completions", json={
            "model": SERVED_MODEL_NAME, "prompt": probe["token_ids"], "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 0})
        response.raise_for_status()
        served = response.json()["choices"][0]["prompt_logprobs"][1:]
        expected = probe["logprobs"]
        if len(served) != len(expected) or len(expected) != len(probe["token_ids"]) - 1:
            raise VerificationFailed(f"the probe has {len(expected)} logprobs, the replica answered {len(served)}")
        return max(abs(entry[str(token)]["logprob"] - want)
                   for token, want, entry in zip(probe["token_ids"][1:], expected, served, strict=True))

    # All at once, so the engine can batch them while the replica is out of rotation.
    with replica_client(url, timeout=60) as http, ThreadPoolExecutor(max(len(probes), 1)) as pool:
        return max(pool.map(worst_of, probes), default=0.0)


def probe_tolerance(settings: Settings) -> float:
    """The probe's tolerance for the replicas liverl starts (they compute in serving.dtype)."""
    return settings.learner.probe_tolerance_for(settings.serving.dtype)


def verify(url: str, model_dir: Path, tolerance: float) -> float:
    diff = probe_diff(url, model_dir)
    if not diff <= tolerance:  # NaN included
        raise VerificationFailed(f"probe logprobs differ by {diff:.2e} (tolerance {tolerance:.0e})")
    return diff


def in_flight(url: str) -> float:
    """Requests a vLLM replica is running or holding, from its Prometheus metrics."""
    with replica_client(url, timeout=5) as http:
        text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def spare_url(settings: Settings, replica: Replica) -> str:
    """Blue/green alternates each replica between two addresses."""
    index = int(replica.name.rsplit("-", 1)[1])
    blue = replica_url(settings, index, 0)
    return replica_url(settings, index, 1) if replica.url == blue else blue


def drain_in_flight(url: str, timeout_s: float) -> float:
    """Let a replica out of rotation finish what it runs; seconds waited."""
    t = time.time()
    wait_until(lambda: in_flight(url) == 0, timeout_s, interval=0.05)
    return time.time() - t


# Set inside `loading_whole()`: `revert` loads the old weights back whole, whatever a
# failed load left (the partial path trusts that the replica holds what it says it holds).
_whole_reload: contextvars.ContextVar[bool] = contextvars.ContextVar("whole_reload", default=False)


@contextlib.contextmanager
def loading_whole():
    """`load_in_place` calls inside load the whole directory (no diff, no partial load)."""
    token = _whole_reload.set(True)
    try:
        yield
    finally:
        _whole_reload.reset(token)


class LoadSteps(dict):
    """Seconds per step of `load_in_place` (a dict, as before); `worker` is the extension's
    answer (mode partial or full, what it loaded, why not partial)."""

    worker: dict


def partial_plan(http: httpx.Client, model_dir: Path) -> tuple[dict, str | None]:
    """The load RPC's arguments for a partial load of `model_dir` (the tensors that differ
    from what the replica holds, hashed here while it serves on), or none and why."""
    served = rpc(http, "inplace_served")
    paths = {(answer or {}).get("path") for answer in served}
    if len(paths) != 1 or (base := next(iter(paths))) is None:
        return {}, f"the replica holds {sorted(map(str, paths))}"
    if not Path(base).is_dir():
        return {}, f"the replica's weights directory {base} is gone"
    changed = changed_tensors(base, model_dir)
    if changed is None:
        return {}, "the tensor layout differs from what the replica holds"
    return {"changed": json.dumps(changed), "base": base}, None


def rpc(http: httpx.Client, method: str, **kwargs: object) -> list:
    return http.post("/collective_rpc", json={"method": method, "kwargs": kwargs}).raise_for_status().json()["results"]


def load_in_place(url: str, model_dir: Path) -> dict[str, float]:
    """Pause keeping in-flight requests, load, drop stale KV, resume; seconds per step
    (`worker_load` is the load as timed inside vLLM's worker, `serving_pause` pause to
    resumed, `diff` finding the changed tensors before the pause).

    Only the tensors that differ from what the replica holds are loaded (with whatever
    else their vLLM modules need; `serving/inplace.py`), so the pause scales with the
    change; the whole directory when that cannot be worked out, inside `revert`, or when
    the worker falls back (it says why in `LoadSteps.worker`)."""
    steps = LoadSteps()
    steps.worker = {}

    def step(name: str, path: str, **request: Any) -> httpx.Response:
        t = time.perf_counter()
        response = http.post(path, **request).raise_for_status()
        steps[name] = time.perf_counter() - t
        return response

    with replica_client(url, timeout=120) as http:
        kwargs: dict[str, object] = {"path": str(model_dir)}
        why_whole = "asked to load it whole" if _whole_reload.get() else None
        if why_whole is None:
            t = time.perf_counter()
            try:
                plan, why_whole = partial_plan(http, model_dir)
            except Exception as error:  # a replica without the partial path, unreadable files...
                plan, why_whole = {}, f"{type(error).__name__}: {error}"
            kwargs.update(plan)
            steps["diff"] = time.perf_counter() - t
        paused = time.perf_counter()
        # clear_cache=false: it only clears the multimodal input cache, through a busy executor
        step("pause", "/pause", params={"mode": "keep", "clear_cache": "false"})
        try:
            loaded = step("load", "/collective_rpc", json={"method": "inplace_load_weights_from_dir",
                                                           "kwargs": kwargs})
            step("reset", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        finally:
            step("resume", "/resume")
            steps["serving_pause"] = time.perf_counter() - paused
    # Figures for reports only: their absence must not fail a swap that succeeded.
    steps.worker = (loaded.json().get("results") or [{}])[0] or {}
    steps.worker.setdefault("fallback", None)
    if why_whole and not steps.worker["fallback"]:
        steps.worker["fallback"] = why_whole
    steps["worker_load"] = steps.worker.get("load_s", math.nan)
    return steps


def prehash(*model_dirs: Path | str) -> None:
    """Hash the directories' tensors now, while the replica still serves (cached: the load's
    diff then costs nothing out of rotation). Best effort: the load finds out for itself."""
    for model_dir in model_dirs:
        try:
            tensor_digests(model_dir)
        except Exception:
            pass


def swap_in_place(settings: Settings, name: str, version: str, model_dir: Path, enable: bool = True) -> SwapReport:
    old = read_pool(settings).get(name)
    report = SwapReport(replica=name, version=version, ok=False, mode="inplace")
    prehash(old.model_dir, model_dir)
    paused = time.time()
    set_replica(settings, name, enabled=False)
    try:
        report.drain_s = drain_in_flight(old.url, settings.serving.swap_drain_s)
        t = time.time()
        steps = load_in_place(old.url, model_dir)
        report.load_s = steps.get("serving_pause", time.time() - t)
        report.diff_s = steps.get("diff", 0.0)
        worker = getattr(steps, "worker", {})
        report.load_mode, report.load_fallback = worker.get("mode"), worker.get("fallback")
        report.loaded_tensors, report.loaded_bytes = worker.get("tensors", 0), worker.get("loaded_bytes", 0)
        t = time.time()
        report.max_logprob_diff = verify(old.url, model_dir, probe_tolerance(settings))
        report.verify_s = time.time() - t
        set_replica(settings, name, enabled=enable, policy_version=version, model_dir=str(model_dir))
        report.ok = True
    except Exception as error:  # whatever failed, the replica goes back to verified old weights
        report.error = f"{type(error).__name__}: {error}"
        report.reverted = revert(settings, old, enable)
    report.pause_s = time.time() - paused
    return report


def revert(settings: Settings, old: Replica, enable: bool = True) -> bool:
    """Back to the weights the replica had, loaded whole (whatever a failed load left) and
    verified; a restart if even that fails."""
    try:
        with loading_whole():
            load_in_place(old.url, Path(old.model_dir))
        verify(old.url, Path(old.model_dir), probe_tolerance(settings))
    except Exception:
        return swap_by_restart(settings, old.name, old.policy_version, Path(old.model_dir), enable).ok
    set_replica(settings, old.name, enabled=enable)
    return True


def restore_abandoned(settings: Settings) -> dict[str, bool]:
    """Production replicas left out of rotation by a process killed mid-swap or mid-lend
    (disabled, not lent, and nobody holds their lock): their recorded weights loaded again
    and verified (the engine may have stopped paused, or half loaded), a restart if that
    fails, and back in rotation. Each one found, and whether it is back."""
    restored = {}
    for name in [r.name for r in read_pool(settings).general if not r.enabled]:
        with replica_lock(settings, name, wait=False) as held:
            replica = read_pool(settings).get(name)  # as it is now that nobody else moves it
            if held and not replica.enabled and replica.alias is None:
                restored[name] = revert(settings, replica)
    return restored


def stop_abandoned_engines(settings: Settings) -> list[Replica]:
    """New engines of blue/green swaps a killed process left in `pool.starting` (nobody
    holds their replica's lock; the old engine serves on): stopped and forgotten. Those."""
    stopped = []
    for engine in read_pool(settings).starting:
        with replica_lock(settings, engine.name, wait=False) as held:
            if held and engine in read_pool(settings).starting:
                if engine.pid:
                    stop_pid(engine.pid)
                with edit_pool(settings) as pool:
                    pool.starting = [r for r in pool.starting if r != engine]
                stopped.append(engine)
    return stopped


def replace_replica(settings: Settings, name: str, version: str, model_dir: Path,
                    enable: bool = True) -> SwapReport:
    """`name` on `version`, verified, or back on its old weights; taking traffic afterwards
    unless `enable` is False (a replica on its way back from rollouts: its caller enables
    it once it is no longer lent, or the worker would start groups on it)."""
    weights, staging = stage(settings, name, version, model_dir)
    if settings.serving.swap == "inplace":
        report = swap_in_place(settings, name, version, weights, enable)
    else:
        report = swap_by_restart(settings, name, version, weights, enable)
    report = report.model_copy(update=staging)
    if settings.sync.transport == "delta":
        replica = ReplicaSync.of(settings, name)
        if report.ok and report.transport == "delta":
            replica.commit(version)
        else:
            replica.abort(report.error or report.sync_error or "")
    return report


def stage(settings: Settings, name: str, version: str, model_dir: Path) -> tuple[Path, dict]:
    """The directory to load and the transfer's figures for the report: with the delta
    transport, `version` rebuilt and verified in the replica's own directory while it
    serves on; the registry's `model_dir` if that fails."""
    if settings.sync.transport != "delta":
        return model_dir, {}
    try:
        weights, transfer = ReplicaSync.of(settings, name).stage(version)
    except Exception as error:  # whatever broke the delta path, the full directory still serves
        return model_dir, {"sync_error": f"{type(error).__name__}: {error}"}
    return weights, {"transport": "delta", "fetched_bytes": transfer.fetched_bytes,
                     "weights_bytes": transfer.weights_bytes, "fetch_s": transfer.fetch_s,
                     "decode_s": transfer.decode_s + transfer.verify_s}


def swap_by_restart(settings: Settings, name: str, version: str, model_dir: Path,
                    enable: bool = True) -> SwapReport:
    old = read_pool(settings).get(name)
    report = SwapReport(replica=name, version=version, ok=False, mode="restart")
    started = time.time()
    new, process = launch_replica(settings, name, model_dir, spare_url(settings, old), version)
    with edit_pool(settings) as pool:  # in the pool from its first second, so `down` stops it too
        pool.starting.append(new)
    try:
        wait_replica(settings, new, process)
        report.start_s = time.time() - started
        t = time.time()
        report.max_logprob_diff = verify(new.url, model_dir, probe_tolerance(settings))
        report.verify_s = time.time() - t
    except Exception as error:  # the old replica serves on untouched
        stop_pid(process.pid)
        with edit_pool(settings) as pool:
            pool.starting = [r for r in pool.starting if r.pid != new.pid]
        report.error = f"{type(error).__name__}: {error}"
        return report
    with edit_pool(settings) as pool:  # one write: never in both lists, never in neither
        pool.starting = [r for r in pool.starting if r.pid != new.pid]
        # Whatever the replica is for stays (lent to rollouts, a team's alias): only the engine changes.
        pool.replicas = [new.model_copy(update={"alias": r.alias, "enabled": enable}) if r.name == name else r
                         for r in pool.replicas]
    report.drain_s = drain_in_flight(old.url, settings.serving.request_timeout_s)
    if old.pid:
        stop_pid(old.pid)
    report.ok = True
    return report


def roll_out(settings: Settings, version: str, model_dir: Path, leave_one: bool = False) -> list[SwapReport]:
    """Canary first: one replica, verified; then the rest. Stops at the first failure. A
    team's dedicated replica keeps its version, and one lent to rollouts meanwhile is the
    capacity scheduler's to bring back (onto stable). `leave_one`: the first replica not
    on `version` is left as it is (for the next canary)."""
    reports = []
    for name in [r.name for r in read_pool(settings).general]:
        with replica_lock(settings, name):
            replica = read_pool(settings).get(name)  # as it is now that nobody else moves it
            if replica.alias is not None or replica.policy_version == version:
                continue
            if leave_one:
                leave_one = False
                continue
            report = replace_replica(settings, name, version, model_dir)
        reports.append(report)
        if not report.ok:
            break
    return reports
