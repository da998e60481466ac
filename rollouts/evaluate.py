"""An environment's pass rate for a policy's weights, sampled with transformers (no replica
needed): what the demo plots per version and `benchmarks/bench_coding_env.py` reports."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.environment import Environment, Task


def task_set(tasks: list[Task]) -> str:
    """Names a set of tasks: only figures on the same set compare (task by task, or as one curve)."""
    return hashlib.sha256("\n".join(t.task_id for t in tasks).encode()).hexdigest()[:16]


def first_lines(model, tokenizer, task: Task, samples: int, greedy: bool, max_tokens: int) -> list[str]:
    """`samples` completions of the task (greedy, or at temperature 1), each to its first line."""
    ids = tokenizer(task.prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
                         temperature=None if greedy else 1.0, top_p=None, top_k=None,
                         max_new_tokens=max_tokens, num_return_sequences=samples,
                         pad_token_id=tokenizer.eos_token_id)
    return [tokenizer.decode(row[ids.shape[1]:]).split("\n")[0] for row in out]


def greedy_solved(model_dir: Path, environment: Environment, tasks: list[Task], max_tokens: int = 16,
                  scoring_threads: int = 2) -> list[bool]:
    """Whether the policy at `model_dir` solves each of `tasks` with its greedy completion."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lines = [first_lines(model, tokenizer, task, 1, True, max_tokens)[0] for task in tasks]
    with ThreadPoolExecutor(scoring_threads) as scoring:
        return list(scoring.map(environment.solved, tasks, lines))


def greedy_pass_rate(model_dir: Path, environment: Environment, tasks: list[Task], max_tokens: int = 16) -> float:
    """The share of `tasks` the policy at `model_dir` solves with its greedy completion."""
    return sum(greedy_solved(model_dir, environment, tasks, max_tokens)) / len(tasks)
