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
    import torch  # only the callers that load weights pay for torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a `--json` answer stays JSON
    sequences = [(ids, n) for ids, n in sequences if len(ids) > n >= 1]
    if not sequences:
        return None
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (reference_dir, candidate_dir)]
    total, positions = 0.0, 0
    with torch.no_grad():
        for ids, prompt_length in sequences:
            tokens = torch.tensor([ids])
            # Position i predicts token i + 1: the completion's tokens are predicted from prompt_length - 1 on.
            ref, new = (torch.log_softmax(m(input_ids=tokens).logits[0, prompt_length - 1 : -1].float(), -1)
                        for m in models)
            total += (ref.exp() * (ref - new)).sum().item()
            positions += ref.shape[0]
    return total / positions
