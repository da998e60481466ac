"""The learning issue's fast harness: the learner's update under the demo's serving lag, in
one process, a few minutes a run and the same result for the same seed.

The full demo (`bench_learning.py`) runs nine processes on two cores; its timing, and so
its learning, differs between two runs of one seed (docs/history.md). This harness keeps
what decides how the update learns and drops the rest: the real `Trainer` (the learner's
loss, advantages, importance weights and router replay), the starter policy, the demo's
prompts and its users' hidden rule, and versions that serve only some versions after
they were written, as under the canary guard (a canary `--canary-lag` versions behind the
learner on `--canary-share` of the traffic, stable `--stable-lag` behind on the rest).
Serving is the published bf16 rounding of the weights, sampled at temperature 1 with
`generate` (no vLLM, no broker, no guard): a round samples `--batch` completions, the
learner trains one version on them (the demo's 15% hold-out kept out), repeat.

    .venv/bin/python benchmarks/bench_ablation.py --seeds 0 --seeds 1 --seeds 2 --seeds 3 --seeds 4 \
        --stable-lag 5 --canary-lag 2 --set entropy_coef=0.01 --out bench-ablation/entropy

`--set` takes `LearnerConfig` fields (the demo's values are the defaults here). Runs go
`--jobs` at a time (one torch thread each). Writes each run's curve and per-version
diagnostics (accept rate, entropy, KL from parent, mean IS weight) to `--out`, prints
the table (each run, the median and the range) and plots the runs.
"""

from __future__ import annotations

import json
import random
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.demo import demo_settings, hidden_rule, make_prompt
from learner.trainer import Trainer
from liverl.contracts import RewardedSample, Trajectory
from liverl.settings import LearnerConfig, Settings
from policies.starter import build_starter_policy

console = Console()
HOLDOUT = 0.15


def learner_config(overrides: dict) -> LearnerConfig:
    """The demo's learner (`app/demo.py: demo_settings`) with `overrides`, validated."""
    return LearnerConfig(**{**demo_settings().learner.model_dump(), **overrides})


def published(trainer: Trainer) -> dict[str, torch.Tensor]:
    """What a replica serves: the bf16 rounding of the master weights (computed in fp32)."""
    return {k: v.detach().to(torch.bfloat16).float() for k, v in trainer.master_state().items()}


def sample(model, tokenizer, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids up to and with EOS, their logprobs) at temperature 1, no top-k."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             output_scores=True, return_dict_in_generate=True)
    new = out.sequences[:, enc.input_ids.shape[1]:]
    logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # [B, new, V]
    chosen = logp.gather(-1, new[..., None]).squeeze(-1)
    rows = []
    for i in range(len(prompts)):
        prompt = enc.input_ids[i][enc.attention_mask[i].bool()].tolist()
        ids, lps = [], []
        for tok, lp in zip(new[i].tolist(), chosen[i].tolist(), strict=True):
            ids.append(tok)
            lps.append(lp)
            if tok == tokenizer.eos_token_id:
                break
        rows.append((prompt, ids, lps))
    return rows


def run(seed: int, rounds: int, batch: int, max_tokens: int, stable_lag: int, canary_lag: int,
        canary_share: float, overrides: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model_dir = build_starter_policy(Settings().starter.cache_dir, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    config = learner_config(overrides)
    trainer = Trainer(model_dir, config)
    served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    versions = [published(trainer)]  # versions[k]: what v{k} serves
    curve, per_version = [], []
    for k in range(rounds):
        arms = {"stable": max(0, k - stable_lag), "canary": max(0, k - canary_lag)}
        samples, verdicts = [], []
        for arm, share in (("canary", canary_share), ("stable", 1 - canary_share)):
            n = round(batch * share)
            if not n:
                continue
            prompts = [make_prompt(rng) for _ in range(n)]
            served.load_state_dict(versions[arms[arm]])
            rows = sample(served, tokenizer, prompts, max_tokens)
            for prompt, (p_ids, c_ids, lps) in zip(prompts, rows, strict=True):
                ok = hidden_rule(prompt, tokenizer.decode(c_ids, skip_special_tokens=True))
                verdicts.append(ok)
                i = len(samples)
                trajectory = Trajectory(event_id=f"t{k}-{i}", tenant="bench", completion_id=f"c{k}-{i}",
                                        policy_version=f"v{arms[arm]}", prompt_token_ids=p_ids,
                                        completion_token_ids=c_ids, completion_logprobs=lps)
                samples.append(RewardedSample(sample_id=f"bench:c{k}-{i}", event_id=f"r{k}-{i}", tenant="bench",
                                              reward=float(ok), reward_source="feedback", reward_fn_version="bench",
                                              accepted=ok, trajectory=trajectory))
        curve.append(sum(verdicts) / len(verdicts))
        train = [s for s in samples if rng.random() >= HOLDOUT]
        metrics = trainer.train(train, seed=k)
        versions.append(published(trainer))
        per_version.append({"version": k + 1, "served_accept": curve[-1], "stable": arms["stable"],
                            "canary": arms["canary"],
                            **{m: metrics.get(m) for m in ("lr", "entropy", "kl_from_parent", "mean_is_weight",
                                                           "clipped_fraction", "grad_norm")}})
        if (old := k - max(stable_lag, canary_lag)) >= 0:
            versions[old] = None  # never served again: memory stays flat
    starter = curve[0]
    window = max(1, round(0.2 * rounds))  # the last fifth: the demo's last two of ten minutes
    # About the demo's "last 100 verdicts": the mean of a round's accept rate and the one before.
    rolling = [(curve[i] + curve[max(0, i - 1)]) / 2 for i in range(len(curve))]
    return {"seed": seed, "starter": starter, "last_fifth": sum(curve[-window:]) / window,
            "rounds_to_plus_40": next((i for i, r in enumerate(rolling) if r >= starter + 0.4), None),
            "curve": curve, "versions": per_version}


def main(seeds: list[int] = typer.Option([0, 1, 2, 3, 4], "--seeds"), rounds: int = 60, batch: int = 96,
         max_tokens: int = 24,
         stable_lag: int = typer.Option(5, help="Versions stable serves behind the learner's newest (0: at once)."),
         canary_lag: int = typer.Option(2, help="Versions the canary serves behind the learner's newest."),
         canary_share: float = 0.5, set_: list[str] = typer.Option([], "--set", help="LearnerConfig field=value"),
         jobs: int = 2, out: Path = Path("bench-ablation/run")) -> None:
    overrides = {}
    for item in set_:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)  # numbers, true/false, lists
        except ValueError:
            overrides[key] = value  # a word: objective=ppo
    learner = learner_config(overrides)  # a bad setting stops here, not in every worker
    build_starter_policy(Settings().starter.cache_dir)  # once, before the workers need it
    out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(jobs) as pool:
        futures = {s: pool.submit(run, s, rounds, batch, max_tokens, stable_lag, canary_lag, canary_share, overrides)
                   for s in seeds}
        results = {s: f.result() for s, f in futures.items()}
    setup = {"rounds": rounds, "batch": batch, "stable_lag": stable_lag, "canary_lag": canary_lag,
             "canary_share": canary_share, "learner": learner.model_dump()}
    (out / "result.json").write_text(json.dumps({"setup": setup, "runs": results}, indent=1))
    table = Table(title=f"{overrides or 'demo learner'}; stable {stable_lag} / canary {canary_lag} versions behind")
    for column in ("seed", "starter", "last fifth", "rounds to +40", "entropy at end", "KL from parent (mean)"):
        table.add_column(column, justify="right")
    for s, r in results.items():
        v = r["versions"]
        table.add_row(str(s), f"{r['starter']:.3f}", f"{r['last_fifth']:.3f}", str(r["rounds_to_plus_40"]),
                      f"{v[-1]['entropy']:.2f}", f"{statistics.mean(x['kl_from_parent'] for x in v):.3f}")
    last = [r["last_fifth"] for r in results.values()]
    reached = [r["rounds_to_plus_40"] for r in results.values() if r["rounds_to_plus_40"] is not None]
    table.add_row("median", "", f"{statistics.median(last):.3f}",
                  f"{statistics.median(reached) if reached else '-'} ({len(reached)}/{len(results)})", "", "")
    table.add_row("range", "", f"{min(last):.3f}-{max(last):.3f}", "", "", "")
    console.print(table)
    plot(results, out / "curves.png", str(overrides or "demo learner"))


def plot(results: dict[int, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for seed, r in results.items():
        ax.plot(range(len(r["curve"])), r["curve"], label=f"seed {seed}")
    ax.set(xlabel="version (a round of samples)", ylabel="accept rate served", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    typer.run(main)
