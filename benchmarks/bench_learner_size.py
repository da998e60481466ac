"""The learner's step against model size and training mode, on CPU or a GPU.

    python benchmarks/bench_learner_size.py --device cuda --layers 1 2 4 8 48 --modes full subset lora
    python benchmarks/bench_learner_size.py --device cpu --layers 1 --experts 8 32 128 --modes subset lora

Modes: full, subset (attention and routers in full), lora (rank r on attention and
routers, `learner.lora`), lora-experts (lora plus the 3-D expert stacks through peft's
target_parameters: measured here, not offered by the learner).

Each size is Qwen3-30B-A3B's per-layer shape (policies/real_shape.py) with `--layers`
layers of `--experts` experts, random seeded weights. Per (size, mode) it takes the
learner's step as the service does (policy-gradient loss of learner/rl.py, the PPO
objective around the behaviour logprobs, router replay of the routing a no-grad pass
recorded, logprobs over the real vocabulary in chunks, Adam, grad-norm clip) on
`--rows` sequences of `--length` tokens, and reports: seconds per 1,000 trained tokens
(median of the timed steps after one warm-up), peak memory during the step and resident
between steps, the share of bf16 values of the trained (or, for lora, merged) tensors
that one step changed, what one version touches (bytes of those tensors; for lora also
the adapter's) and the time to copy them into place on the device (a swap of only
them). A (size, mode) whose estimated footprint (learner/modes.py) does not fit in
`--memory-gib` is skipped and said so. Needs torch, transformers and peft only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner import router_replay  # noqa: E402
from learner.logprobs import chunked_token_logprobs  # noqa: E402
from learner.modes import adapted_weights, footprint, lora_params, with_adapters  # noqa: E402
from learner.rl import policy_gradient_loss  # noqa: E402
from policies.real_shape import parameter_count, random_model, real_shape_config  # noqa: E402

GIB = 1024**3
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SUBSET = ["self_attn.", "mlp.gate."]  # the named subset trained in full: attention and routers


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated()
    import psutil

    return psutil.Process().memory_info().rss


def trained_values(config, mode: str, rank: int) -> int:
    """Values `mode` trains of a model of `config` (counted on the meta device)."""
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    if mode == "lora-experts":  # peft's own count: its adapters on 3-D stacks have their own shape
        return sum(p.numel() for p in with_adapters(shell, rank, 2 * rank, ATTENTION, experts=True).parameters()
                   if p.requires_grad)
    return {"full": sum(p.numel() for p in shell.parameters()),
            "subset": sum(w.numel() for n, w in shell.named_parameters() if any(p in n for p in SUBSET)),
            "lora": lora_params(shell, rank, ATTENTION)}[mode]


def model_to_train(config, mode: str, rank: int, device: str) -> torch.nn.Module:
    """The seeded model on `device`, its trained values marked (adapters for lora), routers replayable."""
    lora = mode.startswith("lora")
    model = random_model(config, seed=0, dtype=torch.bfloat16 if lora else torch.float32, device=device)
    if lora:
        model = with_adapters(model, rank, 2 * rank, ATTENTION, experts=mode == "lora-experts")
    else:
        for name, weight in model.named_parameters():
            weight.requires_grad_(mode == "full" or any(p in name for p in SUBSET))
    router_replay.install(model)
    return model


def measure(layers: int, experts: int, mode: str, args) -> dict:
    config = real_shape_config(layers, experts)
    total = parameter_count(config)
    row = {"layers": layers, "experts": experts, "params": total, "mode": mode, "device": args.device}
    trainable = trained_values(config, mode, args.lora_rank)
    # The LoRA base stays bf16 here (its published rounding); full and subset keep fp32 masters.
    need = footprint(total, trainable, weight_bytes=2 if mode.startswith("lora") else 4).total
    row.update(trainable=trainable, estimated_gib=round(need / GIB, 2))
    if need > args.memory_gib * GIB:
        row["skipped"] = f"needs about {need / GIB:.1f} GiB before activations, {args.memory_gib} GiB available"
        return row
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = model_to_train(config, mode, args.lora_rank, args.device)
    row["build_s"] = round(time.perf_counter() - started, 2)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr[mode])
    generator = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(0, 2048, (args.rows, args.length), generator=generator).to(args.device)
    attention = torch.ones_like(input_ids)
    mask = torch.ones(args.rows, args.length - 1, device=args.device)
    advantages = (torch.randint(0, 2, (args.rows,), generator=generator).float() * 2 - 1).to(args.device)
    model.eval()
    with torch.no_grad():  # what serving recorded: its logprobs and its routing
        behaviour = chunked_token_logprobs(model, input_ids, attention) - 0.01
        routing = router_replay.recomputed_routing(model)
    model.train()
    before = {n: w.to(torch.bfloat16).clone() for n, w in adapted_weights(model).items()}
    times = []
    for step in range(args.steps + 1):
        sync(args.device)
        t0 = time.perf_counter()
        with router_replay.replay(model, routing):
            logp = chunked_token_logprobs(model, input_ids, attention)
        loss, _ = policy_gradient_loss(logp, behaviour, advantages, mask, objective="ppo",
                                       proximal_logp=behaviour, is_mode="tis", is_threshold=2.0)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        sync(args.device)
        if step > 0:
            times.append(time.perf_counter() - t0)
        if step == 0:  # one version's worth of change: what a first step moved
            after = {n: w.to(torch.bfloat16) for n, w in adapted_weights(model).items()}
            changed = sum(int((after[n].view(torch.int16) != before[n].view(torch.int16)).sum()) for n in before)
            values = sum(b.numel() for b in before.values())
            row.update(changed_share=round(changed / values, 4), touched_tensors=len(before),
                       touched_bytes=values * 2,
                       changed_share_of_model=round(changed / total, 6))
            sync(args.device)
            t1 = time.perf_counter()  # a swap of only these tensors: copy them into place
            for n, weight in after.items():
                before[n].copy_(weight)
            sync(args.device)
            row["apply_touched_s"] = round(time.perf_counter() - t1, 4)
            if mode.startswith("lora"):
                row["adapter_bytes"] = sum(p.numel() for p in params) * 2  # shipped in bf16
            del after
    tokens = args.rows * (args.length - 1)
    step_s = statistics.median(times)
    row.update(step_s=round(step_s, 3), s_per_1k_tokens=round(step_s / tokens * 1000, 4),
               tokens_per_step=tokens, peak_gib=round(peak_bytes(args.device) / GIB, 2),
               resident_gib=round(resident_bytes(args.device) / GIB, 2))
    del model, optimizer, params, before
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, nargs="+", default=[1])
    parser.add_argument("--experts", type=int, nargs="+", default=[128])
    parser.add_argument("--modes", nargs="+", default=["full", "subset", "lora"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="Memory a mode may use (default: the GPU's, or 80%% of the host's).")
    parser.add_argument("--out", type=Path, default=None, help="Append one JSON line per (size, mode).")
    args = parser.parse_args()
    args.lr = {"full": 1e-6, "subset": 1e-6, "lora": 1e-5, "lora-experts": 1e-5}
    if args.memory_gib is None:
        if args.device.startswith("cuda"):
            args.memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB * 0.85
        else:
            import psutil

            args.memory_gib = psutil.virtual_memory().available / GIB * 0.8
    if not args.device.startswith("cuda"):
        torch.set_num_threads(torch.get_num_threads())
    for experts in args.experts:
        for layers in args.layers:
            for mode in args.modes:
                try:
                    row = measure(layers, experts, mode, args)
                except torch.OutOfMemoryError as error:
                    row = {"layers": layers, "experts": experts, "mode": mode, "oom": str(error)[:200]}
                if args.device.startswith("cuda"):
                    row["gpu"] = torch.cuda.get_device_name(0)
                print(json.dumps(row), flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
