"""Token logprobs without the [batch, tokens, vocabulary] logits in memory.

At a real vocabulary (151,936) the fp32 logits of 4,096 positions are 2.5 GB, and autograd
keeps them and their log-softmax for the backward pass. Here the output layer runs over
chunks of positions, each chunk's logits recomputed in the backward pass (activation
checkpointing), so at most one chunk's logits are alive: memory set by `chunk` rows, not by
the batch. Each row's log-softmax is over the whole vocabulary, as before.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


def causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The HF causal LM inside a peft wrapper (or the model itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    return cast(PreTrainedModel, get_base_model() if get_base_model is not None else model)


def _chunk_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = head(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           chunk: int = 1024) -> torch.Tensor:
    """log pi(x_{j+1} | x_<=j) for every position, [B, T-1], the output layer `chunk` rows at a time."""
    lm = causal_lm(model)
    hidden = lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    batch, length, width = hidden.shape
    rows = hidden[:, :-1].reshape(-1, width)
    targets = input_ids[:, 1:].reshape(-1)
    head = lm.get_output_embeddings()
    parts = [checkpoint(_chunk_logprobs, rows[s : s + chunk], head, targets[s : s + chunk], use_reentrant=False)
             if torch.is_grad_enabled() else _chunk_logprobs(rows[s : s + chunk], head, targets[s : s + chunk])
             for s in range(0, rows.shape[0], chunk)]
    return torch.cat(parts).reshape(batch, length - 1)
