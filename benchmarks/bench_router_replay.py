"""Train/inference mismatch with and without router replay, on the starter policy.

    .venv/bin/python benchmarks/bench_router_replay.py [--sequences 64]
    [--served-device cuda] [--learner-device cuda] [--model-dir DIR --prompts-file FILE]

The mismatch is provoked the way production gets it: completions are sampled with the
policy computing in bf16 (what GPUs serve; on `--served-device cpu` a simulation of it),
which records its routing and token logprobs; the learner then scores the same tokens
in fp32, once recomputing the routers' top-k and once replaying the served routing.
With `--model-dir` and `--prompts-file` (written here by `--write-prompts`) the script
needs only torch, transformers, typer, rich and `learner.router_replay`, so it runs on
a bare GPU machine.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
from pathlib import Path

import torch
import transformers
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner import router_replay

console = Console()


def sample_served(model, tokenizer, prompts: list[str], max_tokens: int):
    """bf16 'inference': sampled ids, their logprobs and the routing actually used (on CPU)."""
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                   do_sample=True, temperature=1.0, pad_token_id=tokenizer.eos_token_id)
        with torch.no_grad():
            logits = model(input_ids=generated).logits.float()
        routing = router_replay.used_routing(model)  # [layers, T, k]
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, generated[0, 1:, None]).squeeze(-1)
        out.append((generated.cpu(), ids.shape[1], logp.cpu(), routing.cpu()))
    return out


def make_prompts(sequences: int, seed: int) -> list[str]:
    from app.demo import make_prompt

    rng = random.Random(seed)
    return [make_prompt(rng) for _ in range(sequences)]


def load(model_dir: Path, dtype: torch.dtype, device: torch.device):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    router_replay.install(model)
    if not router_replay.moe_routers(model):
        names = sorted({type(m).__name__ for m in model.modules()})
        raise SystemExit(f"no *TopKRouter in {model_dir} (transformers {transformers.__version__}): {names}")
    return model


def describe(model) -> dict:
    p = next(model.parameters())
    name = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else f"cpu {platform.machine()}"
    return {"device": str(p.device), "name": name, "dtype": str(p.dtype).removeprefix("torch."),
            "attn": model.config._attn_implementation,
            "experts": getattr(model.config, "_experts_implementation", None)}


def main(sequences: int = 64, max_tokens: int = 24, seed: int = 0,
         served_device: str = "cpu", learner_device: str = "cpu",
         model_dir: Path | None = typer.Option(None, help="HF checkpoint; default: build or find the starter."),
         prompts_file: Path | None = typer.Option(None, help="JSONL of prompt strings; default: the demo's."),
         write_prompts: Path | None = typer.Option(None, help="Write the prompts as JSONL and exit.")) -> None:
    if write_prompts:
        write_prompts.write_text("".join(json.dumps(p) + "\n" for p in make_prompts(sequences, seed)))
        return
    if prompts_file:
        prompts = [json.loads(line) for line in prompts_file.read_text().splitlines() if line.strip()]
        if len(prompts) < sequences:
            raise SystemExit(f"{prompts_file} holds {len(prompts)} prompts, under --sequences {sequences}")
        prompts = prompts[:sequences]
    else:
        prompts = make_prompts(sequences, seed)
    if model_dir is None:
        from liverl.settings import Settings
        from policies.starter import build_starter_policy

        model_dir = build_starter_policy(Settings().starter.cache_dir)

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    served = load(model_dir, torch.bfloat16, torch.device(served_device))
    learner = load(model_dir, torch.float32, torch.device(learner_device))
    samples = sample_served(served, tokenizer, prompts, max_tokens)
    digest = hashlib.sha256(b"".join(g.numpy().tobytes() for g, *_ in samples)).hexdigest()[:12]

    results = {}
    for mode in ("recomputed routing", "router replay"):
        diffs, flips, tokens = [], 0.0, 0
        for generated, prompt_len, behaviour, routing in samples:
            record = routing.to(learner.device) if mode == "router replay" else None
            with torch.no_grad(), router_replay.replay(learner, record):
                logits = learner(input_ids=generated.to(learner.device)).logits.float()
            target = generated[0, 1:, None].to(learner.device)
            logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, target).squeeze(-1).cpu()
            completion = slice(prompt_len - 1, None)
            diffs.append((logp[completion] - behaviour[completion]).abs())
            mask = torch.ones(generated.shape[1])
            n = generated.shape[1] * routing.shape[0]
            used = router_replay.used_routing(learner).cpu()
            flips += router_replay.routing_mismatch(used, routing, mask) * n
            tokens += n
        d = torch.cat(diffs)
        results[mode] = {"mean_abs_logprob_diff": d.mean().item(), "max_abs_logprob_diff": d.max().item(),
                         "routing_mismatch_fraction": flips / tokens, "completion_tokens": d.numel()}

    s, t = describe(served), describe(learner)
    table = Table(title=f"{s['dtype']} served on {s['name']} vs {t['dtype']} trained on {t['name']}, "
                        f"{sequences} sequences")
    for column in ("learner routing", "mean |dlogp|", "max |dlogp|", "routing differs"):
        table.add_column(column, justify="right")
    for mode, r in results.items():
        table.add_row(mode, f"{r['mean_abs_logprob_diff']:.2e}", f"{r['max_abs_logprob_diff']:.2e}",
                      f"{r['routing_mismatch_fraction']:.2%}")
    console.print(table)
    print(json.dumps({**results, "served": s, "learner": t, "sequences": sequences, "samples_sha256": digest,
                      "torch": torch.__version__, "transformers": transformers.__version__}))


if __name__ == "__main__":
    typer.run(main)
