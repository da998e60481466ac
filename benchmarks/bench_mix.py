"""Training for both, fast: how a mixing policy keeps the coding skill rollouts teach while
production feedback trains the demo's hidden rule (issue 46). One process, no broker, vLLM
or guard, as `bench_ablation.py` (whose sampling and serving lag it reuses).

A compressed day: `--trough-rounds` versions of rollouts alone (the night's lent replica:
`--groups` coding groups of `--group-size` at temperature 1 per version, scored in the
sandbox), then `--day-rounds` versions of production alone (96 completions of the demo's
prompts judged by its users' rule, stable `--stable-lag` and the canary `--canary-lag`
versions behind), each mixed by the policy under test:

- `none`: production alone (the demo before issue 46);
- `replay`: `learner.replay_groups` of the night's groups trained again beside production
  (`learner/mix.py`, the learner's own buffer), with the night's behaviour logprobs;
- `anchor`: as replay, each replayed group as if sampled now (`learner/mix.py:
  as_if_sampled_now`: importance weight 1);
- `rise`: as replay, with the count doubled while the latest held-out figure is more than
  5 points under the night's (a share that rises when the skill falls);
- `kl`: production alone with a KL to the night's last version (`--set kl_coef=...`), the
  anchor to the last version that held the skill.

Any of them with `--set skill_anchor_coef=1`: each version holds its parent's likelihood of
`skill_anchor_samples` passed completions from the buffer (`learner/rl.py: skill_anchor_loss`).
Any of them with `--set max_skill_anchor_drop=0.05`: a version that lowered those completions
by more than that is trained again at half the lr (`learner/rl.py: backtracked`).
Any of them with `--set settled_reward=0.8` (and `settled_lr_scale`): a version whose
production accept reached it steps a share of the lr (`learner/mix.py: settled_step`).
Any of them with `--set own_groups=4`: each day version also trains 4 groups the learner samples
itself from its parent (`learner/own_groups.py`).

Held-out: `--heldout` tasks greedily (`rollouts/evaluate.py`, as the evaluator) at the
start, after the night and every `--eval-every` versions of the day.

    .venv/bin/python benchmarks/bench_mix.py --policy replay --set replay_groups=4 --out bench-mix/replay4
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from bench_ablation import HOLDOUT, learner_config, published, sample  # noqa: E402

from app.demo import hidden_rule, make_prompt  # noqa: E402
from learner.mix import ReplayBuffer, as_if_sampled_now, settled_step  # noqa: E402
from learner.own_groups import OwnGroups  # noqa: E402
from learner.skill_check import SkillCheck  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from liverl.contracts import RewardedSample, Trajectory  # noqa: E402
from liverl.settings import RolloutsConfig, Settings  # noqa: E402
from policies.starter import build_starter_policy  # noqa: E402
from rollouts.coding import CodingEnvironment  # noqa: E402
from rollouts.evaluate import greedy_solved  # noqa: E402

console = Console()


def rewarded(k: int, i: int, version: int, ids: tuple[list[int], list[int], list[float]], reward: float,
             group: str | None = None, size: int | None = None) -> RewardedSample:
    p_ids, c_ids, lps = ids
    trajectory = Trajectory(event_id=f"t{k}-{i}", tenant="bench", completion_id=f"c{k}-{i}",
                            policy_version=f"v{version}", prompt_token_ids=p_ids, completion_token_ids=c_ids,
                            completion_logprobs=lps, group_id=group, group_size=size,
                            source="rollout" if group else "gateway")
    return RewardedSample(sample_id=f"bench:c{k}-{i}", event_id=f"r{k}-{i}", tenant="bench", reward=reward,
                          reward_source="feedback", reward_fn_version="bench", accepted=reward >= 1.0,
                          trajectory=trajectory)


def first_line(tokenizer, row: tuple[list[int], list[int], list[float]]) -> tuple[list[int], list[int], list[float]]:
    """A rollout completion up to and with its first newline token (the task's stop)."""
    p_ids, c_ids, lps = row
    for end, tok in enumerate(c_ids):
        if "\n" in tokenizer.decode([tok]):
            return p_ids, c_ids[:end + 1], lps[:end + 1]
    return row


def groups(env, tasks, model, tokenizer, k: int, version: int, count: int, size: int) -> list[RewardedSample]:
    """`count` scored groups of `size` completions of training tasks."""
    out = []
    for g in range(count):
        task = next(tasks)
        rows = [first_line(tokenizer, r) for r in sample(model, tokenizer, [task.prompt] * size, 16)]
        for j, row in enumerate(rows):
            score = env.score(task, tokenizer.decode(row[1], skip_special_tokens=True))
            out.append(rewarded(k, g * size + j, version, row, score, group=f"g{k}-{g}", size=size))
    return out


def production(model_for, tokenizer, rng, k: int, batch: int, lags: dict[str, tuple[int, float]]) -> tuple[
        list[RewardedSample], float]:
    """A round of production: (samples, accept rate), each arm served by its version."""
    samples, verdicts = [], []
    for version, share in lags.values():
        prompts = [make_prompt(rng) for _ in range(round(batch * share))]
        for prompt, row in zip(prompts, sample(model_for(version), tokenizer, prompts, 24), strict=True):
            ok = hidden_rule(prompt, tokenizer.decode(row[1], skip_special_tokens=True))
            verdicts.append(ok)
            samples.append(rewarded(k, len(samples), version, row, float(ok)))
    return samples, sum(verdicts) / len(verdicts)


def run(seed: int, policy: str, overrides: dict, trough_rounds: int, day_rounds: int, groups_per_round: int,
        group_size: int, heldout: int, eval_every: int, stable_lag: int, canary_lag: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model_dir = build_starter_policy(Settings().starter.cache_dir, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    config = learner_config(overrides)
    trainer = Trainer(model_dir, config)
    served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    env = CodingEnvironment(levels=[1, 2], train_params="wide")
    tasks, held = env.tasks("train", random.Random(seed)), env.heldout(heldout)
    versions, known, buffer = [published(trainer)], {}, ReplayBuffer(config.replay_buffer)
    scratch = Path(tempfile.mkdtemp(prefix="bench-mix-"))

    def model_for(version: int):
        served.load_state_dict(versions[version])
        return served

    def evaluate() -> float:
        trainer.export(scratch / "eval")
        return sum(greedy_solved(scratch / "eval", env, held, known=known)) / len(held)

    curve, evals, moves = [], [(0, evaluate())], []  # moves: each day version's step (KL, anchor drop, backtracks)
    # With `--set skill_check_tasks=N`, the learner's own greedy check against its parent and stable.
    check = None if not config.skill_check_tasks else SkillCheck(env, config.skill_check_tasks,
                                                                 config.skill_check_margin, 16)
    if check is not None:
        trainer.skill(check)
        check.remember("0")

    def trained(samples: list[RewardedSample], k: int, stable: int, lr_scale: float = 1.0) -> dict:
        """A version of `samples` (the parent: version k), held to the check's floor if any."""
        floor = None if check is None else check.floor((str(k), ""), (str(stable), ""))
        metrics = trainer.train(samples, seed=k, lr_scale=lr_scale, skill_check=check, skill_floor=floor,
                                anchor=buffer.passed(config.skill_anchor_samples, k))
        if check is not None:
            check.remember(str(k + 1))
        versions.append(published(trainer))
        return metrics

    own = OwnGroups(env, config.own_groups, RolloutsConfig(group_size=group_size, max_tokens=16)) if (
        config.own_groups) else None
    if config.kl_coef > 0:  # kl_reference=stable: the starter through the night, then the night's last version
        trainer.use_reference(model_dir)
    for k in range(trough_rounds):
        night = groups(env, tasks, model_for(k), tokenizer, k, k, groups_per_round, group_size)
        buffer.remember(night[i:i + group_size] for i in range(0, len(night), group_size)
                        if len({s.reward for s in night[i:i + group_size]}) > 1)
        trained(night, k, stable=0)
    evals.append((trough_rounds, evaluate()))
    if policy == "kl":
        trainer.export(scratch / "anchor")
        trainer.use_reference(scratch / "anchor")
    for k in range(trough_rounds, trough_rounds + day_rounds):
        lags = {"canary": (max(0, k - canary_lag), 0.5), "stable": (max(0, k - stable_lag), 0.5)}
        samples, rate = production(model_for, tokenizer, rng, k, 96, lags)
        curve.append(rate)
        train = [s for s in samples if rng.random() >= HOLDOUT]
        count = config.replay_groups if policy in ("replay", "rise", "anchor") else 0
        if policy == "rise" and evals[-1][1] < evals[1][1] - 0.05:
            count *= 2
        replayed = buffer.take(count)
        if policy == "anchor":
            replayed = as_if_sampled_now(trainer, replayed)
        # With `--set own_groups=N`, N groups the learner samples itself from this version's parent.
        replayed += own.sample(trainer, str(k), k) if own else []
        # With `--set settled_reward=...`, the learner's smaller step once production is learned.
        step = settled_step([s.reward for s in samples], 0, config.settled_reward, config.settled_lr_scale)
        metrics = trained(train + replayed, k, stable=lags["stable"][0], lr_scale=step)
        moves.append({key: metrics.get(key) for key in ("kl_from_parent", "skill_anchor_drop", "backtracks", "lr",
                                                        "skill_check_pass_rate", "skill_check_floor")})
        if (k - trough_rounds + 1) % eval_every == 0:
            evals.append((k + 1, evaluate()))
            print(f"{policy} seed {seed} version {k + 1}: accept {rate:.3f}, held-out {evals[-1][1]:.3f}", flush=True)
    window = max(1, round(0.2 * day_rounds))
    return {"seed": seed, "starter_accept": curve[0], "last_fifth": sum(curve[-window:]) / window,
            "heldout": evals, "curve": curve, "moves": moves}


def main(policy: str = typer.Option("none", help="none, replay, anchor, rise or kl"),
         seeds: list[int] = typer.Option([0, 1, 2], "--seeds"), trough_rounds: int = 4, day_rounds: int = 30,
         groups_per_round: int = 8, group_size: int = 8, heldout: int = 200, eval_every: int = 5,
         stable_lag: int = 3, canary_lag: int = 1,
         set_: list[str] = typer.Option([], "--set", help="LearnerConfig field=value"), jobs: int = 1,
         out: Path = Path("bench-mix/run")) -> None:
    overrides = {}
    for key, _, value in (item.partition("=") for item in set_):
        try:
            overrides[key] = json.loads(value)  # numbers, true/false, lists
        except ValueError:
            overrides[key] = value  # a word: kl_reference=stable
    learner_config(overrides)  # a bad setting stops here
    build_starter_policy(Settings().starter.cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = (policy, overrides, trough_rounds, day_rounds, groups_per_round, group_size, heldout, eval_every,
            stable_lag, canary_lag)
    with ProcessPoolExecutor(jobs) as pool:
        futures = {s: pool.submit(run, s, *args) for s in seeds}
        results = {}
        for s, future in futures.items():  # each run kept as it ends: a long ablation stopped keeps what it has
            results[s] = future.result()
            (out / f"seed-{s}.json").write_text(json.dumps(results[s]))
    (out / "result.json").write_text(json.dumps({"policy": policy, "overrides": overrides, "runs": results}, indent=1))
    table = Table(title=f"{policy} {overrides or ''}: {trough_rounds} night versions, {day_rounds} day versions")
    for column in ("seed", "production last fifth", "held-out: starter", "after the night", "lowest in the day",
                   "end of the day"):
        table.add_column(column, justify="right")
    for s, r in results.items():
        h = [rate for _, rate in r["heldout"]]
        table.add_row(str(s), f"{r['last_fifth']:.3f}", f"{h[0]:.3f}", f"{h[1]:.3f}", f"{min(h[2:]):.3f}",
                      f"{h[-1]:.3f}")
    ends = [r["heldout"][-1][1] - r["heldout"][0][1] for r in results.values()]
    table.add_row("median", f"{statistics.median(r['last_fifth'] for r in results.values()):.3f}", "", "", "",
                  f"{statistics.median(ends):+.3f} vs starter")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
