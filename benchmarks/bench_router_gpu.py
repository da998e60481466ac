"""Router replay at a realistic MoE shape on one GPU: bf16 serving against the fp32 learner.

    PYTHONPATH=. python3 benchmarks/bench_router_gpu.py --device cuda --out router_gpu.json
    .venv/bin/python benchmarks/bench_router_gpu.py --device cpu --layers 2 --experts 8 --top-k 2 \
        --hidden 64 --moe-intermediate 32 --heads 4 --kv-heads 2 --head-dim 16 --vocab 512 \
        --sequences 8 --prompt-len 32 --new-tokens 16 --out /tmp/router_cpu.json

A random-initialised Qwen3-MoE (default: Qwen3-30B-A3B's per-layer shape, 128 experts
top-8, with 8 layers and a 32k vocabulary) is built once in fp32 ("the learner") and
copied to bf16 ("served"). Served: random prompts, continuations sampled at temperature
1 by a KV-cached decode loop in bf16, recording each generated token's logprob at decode
time and every (token, MoE layer)'s top-k experts (prefill and decode), as a replica
would. The learner then scores the same tokens teacher-forced in fp32, recomputing the
routing and replaying it (`learner.router_replay`), and bf16 re-scores them the same
way. Batch variance: fixed token sequences scored in bf16 alone (batch 1) and inside a
batch of all of them, teacher-forced as one prefill and as a KV-cached decode, with
default settings and again (a child process, since cuBLAS reads its workspace setting
once) with torch's deterministic algorithms and no reduced-precision reductions. Last,
the forward's time with the stock router, the replayable router capturing, and replaying.

No vLLM: what serves here is transformers' kernels (sdpa attention, grouped-GEMM experts).
Needs torch, transformers, typer, rich and `learner.router_replay` only.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner import router_replay  # noqa: E402

console = Console(width=int(os.environ.get("COLUMNS", 160)))


@dataclass
class Shape:
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass
class Work:
    sequences: int
    prompt_len: int
    new_tokens: int
    chunk: int
    targets: int
    timing_batch: int
    repeats: int
    seed: int
    router_std: list[float]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(shape: Shape, work: Work, device: torch.device):
    """The fp32 learner and its bf16 copy, seeded random weights, routers installed."""
    config = Qwen3MoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=4 * shape.hidden,
        moe_intermediate_size=shape.moe_intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True,
        max_position_embeddings=max(4096, work.prompt_len + work.new_tokens), tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(work.seed)
    with torch.device(device):
        learner = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        served = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        served.load_state_dict(learner.state_dict())
    draw_routers(learner, served, work.router_std[0], work.seed)
    for model in (learner, served):
        model.eval()
        router_replay.install(model)
    if len(router_replay.moe_routers(learner)) != shape.layers:
        raise SystemExit(f"expected {shape.layers} routers, transformers {transformers.__version__} built "
                         f"{len(router_replay.moe_routers(learner))}")
    return learner, served


@torch.no_grad()
def draw_routers(learner, served, std: float, seed: int) -> None:
    """Seeded normal router weights of `std` in both models (a zero or tied router makes
    every decision a tie that float noise breaks; the scale sets how close the calls are)."""
    generator = torch.Generator(device=next(learner.parameters()).device).manual_seed(seed + 1)
    for (name, weight), theirs in zip(learner.named_parameters(), served.parameters(), strict=True):
        if name.endswith("mlp.gate.weight"):
            weight.normal_(0.0, std, generator=generator)
            theirs.copy_(weight)


@torch.no_grad()
def router_stats(model, tokens: torch.Tensor) -> dict:
    """How sharp the routers are on `tokens`: logit std, top-k probability mass, and the gap
    between the k-th and (k+1)-th logit (what a numeric error has to cross to flip a call)."""
    logits = torch.cat([r.float() for r in model(input_ids=tokens, output_router_logits=True,
                                                     logits_to_keep=1).router_logits])
    k = model.config.num_experts_per_tok
    top = logits.topk(k + 1, dim=-1).values
    return {"router_logit_std": logits.std(-1).mean().item(),
            "topk_probability_mass": torch.softmax(logits, -1).topk(k, -1).values.sum(-1).mean().item(),
            "median_kth_gap": (top[:, k - 1] - top[:, k]).median().item()}


def routing_of(model, rows: int, length: int) -> torch.Tensor:
    """[layers, rows, length, k]: the experts the last forward ran."""
    used = router_replay.used_routing(model)
    return used.reshape(used.shape[0], rows, length, used.shape[-1])


def next_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 logprob of each target (logits [..., V], targets [...]), as vLLM reports them."""
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)


def sample(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)


@torch.no_grad()
def decode(model, tokens: torch.Tensor, prompt_len: int, generator: torch.Generator | None = None):
    """KV-cached decode: prefill the prompt, then one token a step. With a generator it samples
    continuations (tokens' tail is ignored); without, it feeds `tokens` (teacher-forced decode).
    Returns tokens [B, T], decode-time logprobs of tokens[:, prompt_len:] [B, G] and the routing
    [layers, B, T, k] (-1 at the last token, which is never fed: a replica never routes it)."""
    rows, length = tokens.shape
    tokens = tokens.clone()
    out = model(input_ids=tokens[:, :prompt_len], use_cache=True, logits_to_keep=1)
    routes = [routing_of(model, rows, prompt_len)]
    logps = []
    for t in range(prompt_len, length):
        logits = out.logits[:, -1]
        if generator is not None:
            tokens[:, t] = sample(logits, generator)[:, 0]
        logps.append(next_logprobs(logits, tokens[:, t]))
        if t + 1 < length:
            out = model(input_ids=tokens[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            routes.append(routing_of(model, rows, 1))
    routing = torch.cat(routes, dim=2)
    last = torch.full_like(routing[:, :, :1], -1)
    return tokens, torch.stack(logps, 1), torch.cat([routing, last], dim=2)


@torch.no_grad()
def score(model, tokens: torch.Tensor, prompt_len: int, routing: torch.Tensor | None, chunk: int):
    """Teacher-forced logprobs of tokens[:, prompt_len:] [B, G], with the routing the forward
    used and the routing its routers would have chosen, both [layers, B, T, k]."""
    rows, length = tokens.shape
    device = next(model.parameters()).device
    logps, used, recomputed = [], [], []
    for start in range(0, rows, chunk):
        part = tokens[start:start + chunk].to(device)
        record = None
        if routing is not None:
            record = routing[:, start:start + chunk].reshape(routing.shape[0], -1, routing.shape[-1]).to(device)
        with router_replay.replay(model, record):
            logits = model(input_ids=part, logits_to_keep=length - prompt_len + 1).logits[:, :-1]
        logps.append(next_logprobs(logits, part[:, prompt_len:]))
        used.append(routing_of(model, part.shape[0], length))
        layers, k = used[-1].shape[0], used[-1].shape[-1]
        recomputed.append(router_replay.recomputed_routing(model).reshape(layers, part.shape[0], length, k))
    return torch.cat(logps), torch.cat(used, 1), torch.cat(recomputed, 1)


def flips(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[layers, B, T] bool: the top-k expert *set* differs, where b has a record (>= 0)."""
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return ~same & (b >= 0).all(-1)


def swapped(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> float:
    """Mean experts of a's set not in b's, over the pairs `where` marks (the flips)."""
    missing = (a[..., :, None] != b[..., None, :]).all(-1).sum(-1).float()
    return missing[where].mean().item() if where.any() else 0.0


def compare(name: str, logp: torch.Tensor, served_logp: torch.Tensor, routing: torch.Tensor,
            served_routing: torch.Tensor, prompt_len: int) -> dict:
    """One row: logprob gap and routing disagreement against the served record."""
    d = (logp.float().cpu() - served_logp.float().cpu()).abs()
    f = flips(routing.cpu(), served_routing.cpu())
    valid = (served_routing.cpu() >= 0).all(-1)
    return {"row": name, "mean_abs_dlogp": d.mean().item(), "p99_abs_dlogp": d.quantile(0.99).item(),
            "max_abs_dlogp": d.max().item(), "logprobs_bitwise_equal": (d == 0).float().mean().item(),
            "routing_differs": f.sum().item() / max(valid.sum().item(), 1),
            "routing_differs_prompt": f[:, :, :prompt_len].sum().item() / max(valid[:, :, :prompt_len].sum().item(), 1),
            "routing_differs_generated": f[:, :, prompt_len:].sum().item() / max(valid[:, :, prompt_len:].sum().item(),
                                                                               1),
            "experts_swapped_per_flip": swapped(routing.cpu(), served_routing.cpu(), f),
            "per_layer_routing_differs": (f.sum((1, 2)).float() / valid.sum((1, 2)).clamp(min=1)).tolist()}


def table(title: str, rows: list[dict]) -> None:
    t = Table(title=title)
    for column in ("scored by", "mean |dlogp|", "p99 |dlogp|", "max |dlogp|", "logp bit-equal",
                   "routing differs", "prompt", "generated", "experts swapped/flip"):
        t.add_column(column, justify="right")
    for r in rows:
        t.add_row(r["row"], f"{r['mean_abs_dlogp']:.2e}", f"{r['p99_abs_dlogp']:.2e}", f"{r['max_abs_dlogp']:.2e}",
                  f"{r['logprobs_bitwise_equal']:.1%}", f"{r['routing_differs']:.3%}",
                  f"{r['routing_differs_prompt']:.3%}", f"{r['routing_differs_generated']:.3%}",
                  f"{r['experts_swapped_per_flip']:.2f}")
    console.print(t)


def per_layer_table(title: str, rows: list[dict]) -> None:
    t = Table(title=title)
    t.add_column("layer", justify="right")
    for r in rows:
        t.add_column(r["row"], justify="right")
    for layer in range(len(rows[0]["per_layer_routing_differs"])):
        t.add_row(str(layer), *(f"{r['per_layer_routing_differs'][layer]:.3%}" for r in rows))
    console.print(t)


def mismatch(learner, served, work: Work, device: torch.device, std: float) -> dict:
    """Serve in bf16, score in fp32 (and bf16) with recomputed and with replayed routing."""
    draw_routers(learner, served, std, work.seed)
    prompts = torch.randint(0, learner.config.vocab_size, (work.sequences, work.prompt_len + work.new_tokens),
                            generator=torch.Generator().manual_seed(work.seed + 2)).to(device)
    start = time.perf_counter()
    tokens, served_logp, served_routing = decode(served, prompts, work.prompt_len,
                                                 torch.Generator(device=device).manual_seed(work.seed + 3))
    sync(device)
    serve_s = time.perf_counter() - start
    stats = router_stats(learner, tokens[:work.chunk])
    console.log(f"router std {std}: served {work.sequences} sequences in {serve_s:.1f} s; router logit std "
                f"{stats['router_logit_std']:.3f}, top-k mass {stats['topk_probability_mass']:.3f}, median gap "
                f"k-th to next {stats['median_kth_gap']:.4f}")
    rows = []
    for name, model, record in (("fp32 learner, recomputed", learner, None),
                                ("fp32 learner, replay", learner, served_routing),
                                ("bf16 prefill, recomputed", served, None),
                                ("bf16 prefill, replay", served, served_routing)):
        logp, used, recomputed = score(model, tokens, work.prompt_len, record, work.chunk)
        rows.append(compare(name, logp, served_logp, used, served_routing, work.prompt_len))
        if model is learner and record is None:
            rows.append(fp32_replica(learner, tokens, logp, used, work.prompt_len))
        if record is not None:  # each layer's own choice, on the replayed (served-like) inputs
            rows.append(compare(name.replace("replay", "recomputed under replay"), logp, served_logp, recomputed,
                                served_routing, work.prompt_len))
    table(f"router std {std} -- served: bf16 decode of {work.sequences} x ({work.prompt_len} prompt + "
          f"{work.new_tokens} sampled) tokens on {device.type} ({serve_s:.1f} s); |dlogp| over the sampled tokens "
          "against the decode-time logprobs; routing over every (token, layer)",
          [r for r in rows if "under replay" not in r["row"]])
    per_layer_table(f"router std {std} -- routing differs per layer: recomputed (earlier flips cascade) and "
                    "recomputed under replay (each layer's own flips)", [r for r in rows if "recomputed" in r["row"]])
    return {"router_std": std, **stats, "serve_seconds": serve_s, "rows": rows}


def fp32_replica(learner, tokens: torch.Tensor, logp: torch.Tensor, used: torch.Tensor, prompt_len: int) -> dict:
    """Were the replica fp32: its decode of the same tokens against the learner's recomputation."""
    _, replica_logp, replica_routing = decode(learner, tokens, prompt_len)
    return compare("fp32 learner, recomputed, vs an fp32 replica", logp, replica_logp, used, replica_routing,
                   prompt_len)


def variance_rows(name: str, alone: list, batch, prompt_len: int) -> dict:
    """Target rows scored alone against the same rows inside the batch."""
    logp_a = torch.cat([a[0] for a in alone])
    routing_a = torch.cat([a[1] for a in alone], 1)
    n = logp_a.shape[0]
    return compare(name, logp_a, batch[0][:n], routing_a, batch[1][:, :n], prompt_len)


def forced(model, tokens: torch.Tensor, prompt_len: int, kind: str):
    """Teacher-forced logprobs of tokens[:, prompt_len:] and the routing, as one prefill or a decode."""
    if kind == "prefill":
        logp, used, _ = score(model, tokens, prompt_len, None, tokens.shape[0])
        return logp, used
    _, logp, routing = decode(model, tokens, prompt_len)
    return logp, routing


def batch_variance(served, work: Work, device: torch.device, label: str) -> list[dict]:
    """bf16 logprobs and routing of `targets` sequences alone against inside a batch of all
    `sequences` (equal lengths: no padding), as one prefill and as a KV-cached decode; and the
    same batch twice (run-to-run)."""
    tokens = torch.randint(0, served.config.vocab_size, (work.sequences, work.prompt_len + work.new_tokens),
                           generator=torch.Generator().manual_seed(work.seed + 4)).to(device)
    p = work.prompt_len
    rows = []
    console.log(f"batch variance ({label})")
    for kind in ("prefill", "decode"):
        batch, again = forced(served, tokens, p, kind), forced(served, tokens, p, kind)
        alone = [forced(served, tokens[i:i + 1], p, kind) for i in range(work.targets)]
        rows.append(variance_rows(f"{kind}: alone vs in batch of {work.sequences}", alone, batch, p))
        rows.append(compare(f"{kind}: batch run twice", again[0], batch[0], again[1], batch[1], p))
    table(f"batch variance, bf16 on {device.type}, {label}: {work.targets} sequences of {p} + {work.new_tokens} "
          "tokens (random ids, teacher-forced); |dlogp| over the last "
          f"{work.new_tokens} tokens, routing over every (token, layer)", rows)
    return rows


def deterministic_settings() -> None:
    """torch's deterministic algorithms, true fp32 and no reduced-precision reductions."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


@contextmanager
def stock_routers(model):
    """transformers' own router forward (install put ours on each instance)."""
    for router in router_replay.moe_routers(model):
        del router.forward
    try:
        yield
    finally:
        router_replay.install(model)


def timed(model, tokens: torch.Tensor, record, backward: bool, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward), router_replay.replay(model, record):
        logits = model(input_ids=tokens).logits
        if backward:
            next_logprobs(logits[:, :-1], tokens[:, 1:]).mean().backward()
    sync(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def timings(model, work: Work, device: torch.device, backward: bool, label: str) -> list[dict]:
    """Forward (and backward) time: stock router, replayable router capturing, replaying."""
    rows_n, length = work.timing_batch, work.prompt_len + work.new_tokens
    console.log(f"timing: {label}")
    tokens = torch.randint(0, model.config.vocab_size, (rows_n, length),
                           generator=torch.Generator().manual_seed(work.seed + 5)).to(device)
    with torch.no_grad():
        model(input_ids=tokens)
    record = router_replay.used_routing(model).clone()
    modes = {"stock router": None, "capture (recompute)": None, "capture + replay": record}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(work.repeats + 1):  # the first round warms up; modes interleaved against drift
        for mode, rec in modes.items():
            if mode == "stock router":
                with stock_routers(model):
                    s = timed(model, tokens, rec, backward, device)
            else:
                s = timed(model, tokens, rec, backward, device)
            if r:
                seconds[mode].append(s)
    base = statistics.median(seconds["stock router"])
    rows = [{"row": f"{label}, {m}", "median_s": statistics.median(s), "min_s": min(s), "runs_s": s,
             "tokens_per_s": rows_n * length / statistics.median(s),
             "overhead_vs_stock": statistics.median(s) / base - 1} for m, s in seconds.items()]
    t = Table(title=f"{label}: {rows_n} x {length} tokens, {work.repeats} timed runs after a warm-up")
    for column in ("mode", "median s", "min s", "tokens/s", "vs stock"):
        t.add_column(column, justify="right")
    for r in rows:
        t.add_row(r["row"], f"{r['median_s']:.4f}", f"{r['min_s']:.4f}", f"{r['tokens_per_s']:,.0f}",
                  f"{r['overhead_vs_stock']:+.1%}")
    console.print(t)
    return rows


def environment(device: torch.device, learner, served) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "attn": served.config._attn_implementation,
            "experts": getattr(served.config, "_experts_implementation", None),
            "parameters": sum(p.numel() for p in learner.parameters()),
            "fp32_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}


def deterministic_child(argv: list[str], device: torch.device) -> dict:
    """Batch variance again in a fresh process: cuBLAS reads its workspace setting once."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the child builds its own copy of the model beside ours
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "deterministic.json"
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
        run = subprocess.run([sys.executable, __file__, *argv, "--phase", "deterministic", "--out", str(out)],
                             env=env, check=False)
        if run.returncode:
            return {"error": f"the deterministic child exited {run.returncode} (its output is above)"}
        return json.loads(out.read_text())


def save(out: Path | None, results: dict) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))


def run_deterministic(served, work: Work, device: torch.device, out: Path | None) -> None:
    deterministic_settings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = batch_variance(served, work, device, "deterministic algorithms, no reduced-precision reductions")
    nondeterministic = sorted({str(w.message).split("\n")[0][:200] for w in caught
                               if "deterministic" in str(w.message)})
    for message in nondeterministic:
        console.print(f"[yellow]not deterministic:[/] {message}")
    save(out, {"rows": rows, "nondeterministic_ops": nondeterministic})


def main(device: str = "cuda", layers: int = 8, experts: int = 128, top_k: int = 8, hidden: int = 2048,
         moe_intermediate: int = 768, heads: int = 32, kv_heads: int = 4, head_dim: int = 128, vocab: int = 32768,
         sequences: int = typer.Option(64, help="Served sequences; also the busy batch of the variance test."),
         prompt_len: int = 256, new_tokens: int = 128,
         chunk: int = typer.Option(16, help="Sequences per teacher-forced scoring forward."),
         targets: int = typer.Option(8, help="Sequences also scored alone in the variance test."),
         timing_batch: int = 8, repeats: int = 5, seed: int = 0,
         router_std: list[float] = typer.Option([0.02, 0.06], help="Std of the random router weights (0.02: "
                                                "Qwen3's init range); the mismatch runs once per value."),
         backward: bool = typer.Option(True, help="Time the learner's forward+backward too."),
         deterministic_check: bool = typer.Option(True, help="Rerun batch variance under deterministic settings."),
         phase: str = typer.Option("all", hidden=True),
         out: Path | None = typer.Option(None, help="Write the results as JSON here (after every section).")) -> None:
    shape = Shape(layers, experts, top_k, hidden, moe_intermediate, heads, kv_heads, head_dim, vocab)
    work = Work(sequences, prompt_len, new_tokens, chunk, targets, timing_batch, repeats, seed, router_std)
    # The deterministic child: the same model and work at the first router scale.
    argv = [a for k, v in {**asdict(shape), **asdict(work), "router_std": router_std[0], "device": device}.items()
            for a in (f"--{k.replace('_', '-')}", str(v))]
    # `timeout`'s TERM as an exception, so subprocess.run kills the deterministic child too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    dev = torch.device(device)
    # The learner computes in true fp32 (no TF32), as learner/ does on a GPU.
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.perf_counter()
    learner, served = build(shape, work, dev)
    if phase == "deterministic":
        del learner
        run_deterministic(served, work, dev, out)
        return
    results: dict = {"shape": asdict(shape), "work": asdict(work), "env": environment(dev, learner, served),
                     "build_seconds": time.perf_counter() - start}
    console.print(results["env"], f"built in {results['build_seconds']:.1f} s")
    results["mismatch"] = []
    for std in router_std:
        results["mismatch"].append(mismatch(learner, served, work, dev, std))
        save(out, results)
    draw_routers(learner, served, router_std[0], seed)  # the rest at the first scale
    results["batch_variance_default"] = batch_variance(served, work, dev, "default settings")
    save(out, results)
    if deterministic_check:
        results["batch_variance_deterministic"] = deterministic_child(argv, dev)
        save(out, results)
    results["timings"] = timings(served, work, dev, False, "bf16 served forward")
    del served
    results["timings"] += timings(learner, work, dev, False, "fp32 learner forward")
    if backward:
        results["timings"] += timings(learner, work, dev, True, "fp32 learner forward+backward")
    results["total_seconds"] = time.perf_counter() - start
    save(out, results)
    console.print(f"done in {results['total_seconds']:.1f} s" + (f", results in {out}" if out else ""))


if __name__ == "__main__":
    typer.run(main)
