"""The first user of a fresh stack: latency of the first completions through the gateway.

Starts the embedded stack (`liverl up`, its own data directory), sends `--requests`
completions one after another as a demo user does, and stops it; `--runs` times over.
Each request after the first is what a warm stack answers, so the first one's excess is
what its first user pays for cold paths (a client per replica, vLLM's first request).

    .venv/bin/python benchmarks/bench_first_request.py --runs 3
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

from app.demo import USER_MAX_TOKENS, make_prompt
from liverl.pool import SERVED_MODEL_NAME
from liverl.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
console = Console()


def liverl(command: str, env: dict[str, str]) -> None:
    subprocess.run([str(ROOT / ".venv/bin/liverl"), command], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def first_requests(data_dir: Path, requests: int) -> list[float]:
    env = dict(os.environ, LIVERL_DATA_DIR=str(data_dir))
    liverl("up", env)
    try:
        settings = Settings(data_dir=data_dir)
        key = json.loads(settings.dev_keys_file.read_text())["tenant_key"]
        rng, seconds = random.Random(0), []
        with httpx.Client(base_url=settings.url(settings.ports.gateway), timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as gateway:
            for _ in range(requests):
                sent = time.perf_counter()
                gateway.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": make_prompt(rng),
                                                      "max_tokens": USER_MAX_TOKENS}).raise_for_status()
                seconds.append(time.perf_counter() - sent)
        return seconds
    finally:
        liverl("down", env)


def main(runs: int = typer.Option(3, help="Fresh stacks, for the spread."),
         requests: int = typer.Option(5, min=2, help="Completions per stack, one after another.")) -> None:
    table = Table(title="the first completions through a fresh stack's gateway")
    for column in ("run", "first", "the rest (median)", "first / rest"):
        table.add_column(column, justify="right")
    firsts = []
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="liverl-first-") as data_dir:
            first, *rest = first_requests(Path(data_dir), requests)
        firsts.append(first)
        table.add_row(str(run + 1), f"{first * 1000:.0f} ms", f"{statistics.median(rest) * 1000:.0f} ms",
                      f"{first / statistics.median(rest):.1f}x")
    console.print(table)
    console.print(f"first request: median {statistics.median(firsts) * 1000:.0f} ms, "
                  f"{min(firsts) * 1000:.0f}-{max(firsts) * 1000:.0f} ms")


if __name__ == "__main__":
    typer.run(main)
