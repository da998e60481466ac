"""How far apart two policy versions are on logged traffic: the KL between them.

The offline gate's importance-weighted estimate says whether a candidate looks better
on held-out samples; it does not say how far the candidate has moved from what users
get now. The KL from stable to the candidate on logged prompts does, and a ceiling on
it (`learner.gate_max_kl`) keeps a candidate that moved far in one step off the canary
however good its estimate looks. `liverl policy diff` prints the same figure for any
two versions.

    KL(ref || new) = sum_v ref_v (log ref_v - log new_v)

exactly over the vocabulary, at every completion position of each logged sequence,
then averaged over positions.
"""

from __future__ import annotations

from pathlib import Path


def kl_between(reference_dir: Path, candidate_dir: Path, sequences: list[tuple[list[int], int]]) -> float | None:
    """Mean per-token KL(reference || candidate) over the completion positions of
    `sequences` (token ids of prompt + completion, and the prompt's length); None
    without any completion position."""
    from transformers.utils import logging as transformers_logging  # only the callers that load weights pay for it

    transformers_logging.disable_progress_bar()  # a `--json` answer stays JSON
    sequences = [(ids, n) for ids, n in sequences if len(ids) > n >= 1]
    if not sequences:
        return None
    # One model in memory at a time (at a real size each is gigabytes): the reference's
    # distributions at the completion positions first, then the candidate's against them.
    reference = list(_completion_logprobs(reference_dir, sequences))  # its model is freed here
    total, count = 0.0, 0
    for ref, new in zip(reference, _completion_logprobs(candidate_dir, sequences), strict=True):
        total += (ref.exp() * (ref - new)).sum().item()
        count += ref.shape[0]
    return total / count


def _completion_logprobs(model_dir: Path, sequences: list[tuple[list[int], int]]):
    """log pi(. | prefix) over the vocabulary at each sequence's completion positions, one
    sequence at a time, under the model in `model_dir` (loaded once, freed after)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, prompt_length in sequences:
            # Position i predicts token i + 1: the completion's tokens are predicted from prompt_length - 1 on.
            logits = model(input_ids=torch.tensor([ids])).logits[0, prompt_length - 1 : -1].float()
            yield torch.log_softmax(logits, -1)
