"""An environment's pass rate for a policy's weights, sampled with transformers (no replica
needed): what the held-out evaluator records per version, the demo plots and
`benchmarks/bench_coding_env.py` reports."""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollouts.environment import Environment, Task


def task_set(tasks: list[Task]) -> str:
    """Names a set of tasks: only figures on the same set compare (task by task, or as one curve)."""
    return hashlib.sha256("\n".join(t.task_id for t in tasks).encode()).hexdigest()[:16]


def first_lines(model, tokenizer, task: Task, samples: int, greedy: bool, max_tokens: int) -> list[str]:
    """`samples` completions of the task (greedy, or at temperature 1), each to its first line."""
    import torch

    ids = tokenizer(task.prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
                         temperature=None if greedy else 1.0, top_p=None, top_k=None,
                         max_new_tokens=max_tokens, num_return_sequences=samples,
                         pad_token_id=tokenizer.eos_token_id)
    return [tokenizer.decode(row[ids.shape[1]:]).split("\n")[0] for row in out]


def greedy_first_lines(model, tokenizer, tasks: list[Task], max_tokens: int, batch: int = 50) -> list[str]:
    """Each task's greedy completion to its first line, `batch` prompts a forward pass (left
    padded): 200 tasks in seconds, not minutes, so a candidate is scored before its canary."""
    tokenizer.padding_side = "left"
    lines: list[str] = []
    for start in range(0, len(tasks), batch):
        enc = tokenizer([t.prompt for t in tasks[start:start + batch]], return_tensors="pt", padding=True)
        out = model.generate(**enc, do_sample=False, temperature=None, top_p=None, top_k=None,
                             max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id,
                             stop_strings=["\n"], tokenizer=tokenizer)  # only the first line is scored
        lines += [tokenizer.decode(row[enc.input_ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
                  for row in out]
    return lines


def greedy_solved(model_dir: Path, environment: Environment, tasks: list[Task], max_tokens: int = 16,
                  scoring_threads: int = 2, known: MutableMapping[tuple[str, str], bool] | None = None) -> list[bool]:
    """Whether the policy at `model_dir` solves each of `tasks` with its greedy completion.
    `known` keeps (task, first line) -> solved across calls: consecutive versions write the
    same line for most tasks, and the sandbox run is most of an evaluation's cost."""
    import torch  # here, not at the top: the evaluator answers its health check before torch loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lines = greedy_first_lines(model, tokenizer, tasks, max_tokens)
    return lines_solved(environment, tasks, lines, {} if known is None else known, scoring_threads)


def lines_solved(environment: Environment, tasks: list[Task], lines: list[str],
                 known: MutableMapping[tuple[str, str], bool], scoring_threads: int = 2) -> list[bool]:
    """Whether each task's line solves it, each (task, line) not in `known` run in the sandbox once."""
    todo = {(t.task_id, line): (t, line) for t, line in zip(tasks, lines, strict=True)
            if (t.task_id, line) not in known}
    with ThreadPoolExecutor(scoring_threads) as scoring:
        known.update(zip(todo, scoring.map(lambda tl: environment.solved(*tl), todo.values()), strict=True))
    return [known[(t.task_id, line)] for t, line in zip(tasks, lines, strict=True)]


def greedy_pass_rate(model_dir: Path, environment: Environment, tasks: list[Task], max_tokens: int = 16) -> float:
    """The share of `tasks` the policy at `model_dir` solves with its greedy completion."""
    return sum(greedy_solved(model_dir, environment, tasks, max_tokens)) / len(tasks)
