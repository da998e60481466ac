"""Train/inference mismatch with and without router replay, on the starter policy.

    .venv/bin/python benchmarks/bench_router_replay.py [--sequences 64]

On CPU the mismatch is provoked the way production gets it: completions are sampled
with the policy computing in bf16 (what GPUs serve), which records its routing and
token logprobs; the learner then scores the same tokens in fp32, once recomputing
the routers' top-k and once replaying the served routing.
"""

from __future__ import annotations

import json
import random

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.demo import make_prompt
from learner import router_replay
from liverl.settings import Settings
from policies.starter import build_starter_policy

console = Console()


def sample_served(model, tokenizer, prompts: list[str], max_tokens: int):
    """bf16 'inference': sampled ids, their logprobs and the routing actually used."""
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                   do_sample=True, temperature=1.0, pad_token_id=tokenizer.eos_token_id)
        with torch.no_grad():
            logits = model(input_ids=generated).logits.float()
        routing = router_replay.used_routing(model)  # [layers, T, k]
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, generated[0, 1:, None]).squeeze(-1)
        out.append((generated, ids.shape[1], logp, routing))
    return out


def main(sequences: int = 64, max_tokens: int = 24, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model_dir = build_starter_policy(Settings().starter.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    router_replay.install(served)
    router_replay.install(learner)
    rng = random.Random(seed)
    samples = sample_served(served, tokenizer, [make_prompt(rng) for _ in range(sequences)], max_tokens)

    results = {}
    for mode in ("recomputed routing", "router replay"):
        diffs, flips, tokens = [], 0.0, 0
        for generated, prompt_len, behaviour, routing in samples:
            with torch.no_grad(), router_replay.replay(learner, routing if mode == "router replay" else None):
                logits = learner(input_ids=generated).logits.float()
            logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, generated[0, 1:, None]).squeeze(-1)
            completion = slice(prompt_len - 1, None)
            diffs.append((logp[completion] - behaviour[completion]).abs())
            mask = torch.ones(generated.shape[1])
            n = generated.shape[1] * routing.shape[0]
            flips += router_replay.routing_mismatch(router_replay.used_routing(learner), routing, mask) * n
            tokens += n
        d = torch.cat(diffs)
        results[mode] = {"mean_abs_logprob_diff": d.mean().item(), "max_abs_logprob_diff": d.max().item(),
                         "routing_mismatch_fraction": flips / tokens, "completion_tokens": d.numel()}

    table = Table(title=f"bf16 served vs fp32 trained, {sequences} sequences")
    for column in ("learner routing", "mean |dlogp|", "max |dlogp|", "routing differs"):
        table.add_column(column, justify="right")
    for mode, r in results.items():
        table.add_row(mode, f"{r['mean_abs_logprob_diff']:.2e}", f"{r['max_abs_logprob_diff']:.2e}",
                      f"{r['routing_mismatch_fraction']:.2%}")
    console.print(table)
    print(json.dumps(results))


if __name__ == "__main__":
    typer.run(main)
