"""Learner throughput: tokens/s of one training version on the starter policy (CPU).

    .venv/bin/python benchmarks/bench_learner.py [--sequences 96] [--threads 1]

Samples completions from the starter in bf16 (with their routing and logprobs, as a
replica records them), gives them random accept/reject rewards and times
`Trainer.train` on them, with and without router replay. Tokens are prompt plus
completion tokens through forward and backward.
"""

from __future__ import annotations

import json
import random
import time

import torch
import typer
from bench_router_replay import sample_served
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.demo import make_prompt
from learner import router_replay
from learner.trainer import Trainer
from liverl.contracts import RewardedSample, Trajectory
from liverl.settings import LearnerConfig, Settings
from policies.starter import build_starter_policy

console = Console()


def rewarded(tokenizer, served, rng: random.Random) -> list[RewardedSample]:
    samples = []
    for i, (generated, prompt_len, logp, routing) in enumerate(served):
        ids = generated[0].tolist()
        trajectory = Trajectory(
            event_id=f"t{i}", tenant="bench", completion_id=f"c{i}", policy_version="v0",
            prompt_token_ids=ids[:prompt_len], completion_token_ids=ids[prompt_len:],
            completion_logprobs=logp[prompt_len - 1:].tolist(),
            routed_experts=routing.permute(1, 0, 2).tolist())  # [tokens, layers, k]
        samples.append(RewardedSample(sample_id=f"c{i}", event_id=f"c{i}:r0", tenant="bench",
                                      reward=float(rng.random() < 0.3), reward_source="feedback",
                                      reward_fn_version="bench", trajectory=trajectory))
    return samples


def main(sequences: int = 96, max_tokens: int = 24, threads: int = 1, repeats: int = 3, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model_dir = build_starter_policy(Settings().starter.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    router_replay.install(served)
    rng = random.Random(seed)
    samples = rewarded(tokenizer, sample_served(served, tokenizer, [make_prompt(rng) for _ in range(sequences)],
                                                max_tokens), rng)
    tokens = sum(len(s.trajectory.prompt_token_ids) + len(s.trajectory.completion_token_ids) for s in samples)
    results = {}
    for replay in (True, False):
        config = LearnerConfig(threads=threads, router_replay=replay)
        trainer = Trainer(model_dir, config)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            trainer.train(samples)
            best = min(best, time.perf_counter() - start)
        results["router replay" if replay else "recomputed routing"] = {
            "seconds": best, "tokens": tokens, "tokens_per_s": tokens * config.epochs / best}
    table = Table(title=f"Trainer.train on {sequences} sequences ({tokens} tokens), {threads} thread(s)")
    for column in ("routing", "seconds per version", "tokens/s"):
        table.add_column(column, justify="right")
    for mode, r in results.items():
        table.add_row(mode, f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}")
    console.print(table)
    print(json.dumps(results))


if __name__ == "__main__":
    typer.run(main)
