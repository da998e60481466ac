"""A trajectory as the learner trains it: segments, each a context the policy read and
the tokens it wrote in it.

A single-turn completion is one segment: the prompt (read), then the completion (written).

A multi-turn trajectory (`turns`, each with the token ids it had in the policy's context)
is cut after every `summary` turn: when its context would overflow, the policy writes a
summary, and the next segment is a fresh context that starts from the task and that
summary (recorded as the segment's first turn). In every segment the loss covers only the
policy's own tokens, its `assistant` and `summary` turns; the task, tool outputs and the
summary carried into a new context were read, not written, so they are masked. The
trajectory's one reward is credited to every segment (the trainer gives each segment its
trajectory's advantage), the summaries' included: a summary that lets the next segment
succeed is reinforced like any other action.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from liverl.contracts import WRITTEN_ROLES, Architecture, Trajectory, Turn, misfit

UNKNOWN = -1  # a token whose routing inference did not record


@dataclass(frozen=True)
class Segment:
    token_ids: list[int]
    written: list[bool]  # per token: the policy sampled it here (in the loss)
    behaviour_logprobs: list[float]  # per token: log mu where written, 0 elsewhere
    routed_experts: np.ndarray | None = None  # [tokens (a prefix), layers, k]; UNKNOWN where not recorded


def segments(t: Trajectory) -> list[Segment]:
    if t.turns is None or not t.multi_turn():
        p, c = t.prompt_token_ids, t.completion_token_ids
        routing = None if t.routed_experts is None else t.routed_experts.array()
        return [Segment(p + c, [False] * len(p) + [True] * len(c), [0.0] * len(p) + list(t.completion_logprobs),
                        routing)]
    out: list[Segment] = []
    current: list[Turn] = []
    for turn in t.turns:
        current.append(turn)
        if turn.role == "summary":  # the context ends here; the next segment starts afresh
            out.append(joined(current))
            current = []
    if current:
        out.append(joined(current))
    return out


def joined(turns: list[Turn]) -> Segment:
    """One context: its turns' tokens in order, the policy's own marked written."""
    ids: list[int] = []
    written: list[bool] = []
    logprobs: list[float] = []
    for turn in turns:
        tokens = turn.token_ids or []
        mine = turn.role in WRITTEN_ROLES
        ids += tokens
        written += [mine] * len(tokens)
        logprobs += list(turn.logprobs or []) if mine else [0.0] * len(tokens)
    return Segment(ids, written, logprobs, joined_routing(turns))


def joined_routing(turns: list[Turn]) -> np.ndarray | None:
    """The turns' routing records end to end, each padded with UNKNOWN to its turn's
    length; None when no turn has one."""
    records = [(len(turn.token_ids or []), turn.routed_experts) for turn in turns]
    shape = next((r.shape[1:] for _, r in records if r is not None), None)
    if shape is None:
        return None
    out = np.full((sum(n for n, _ in records), *shape), UNKNOWN, dtype=np.int32)
    start = 0
    for n, record in records:
        if record is not None:
            out[start: start + record.shape[0]] = record.array()
        start += n
    return out


def written_tokens(t: Trajectory) -> int:
    """How many tokens of `t` the loss covers."""
    return sum(sum(s.written) for s in segments(t))


def turns_problem(t: Trajectory, arch: Architecture) -> str | None:
    """Why a multi-turn trajectory's turns cannot be trained on, or None."""
    vocab_size = arch.vocab_size
    assert t.turns is not None, "a multi-turn trajectory has turns (Trajectory.multi_turn)"
    for i, turn in enumerate(t.turns):
        tokens = turn.token_ids
        assert tokens is not None, "every turn of a multi-turn trajectory has its token ids"
        if not all(0 <= x < vocab_size for x in tokens):
            return f"turn {i}: token ids must be in [0, {vocab_size})"
        if turn.role in WRITTEN_ROLES:
            if turn.logprobs is None or len(turn.logprobs) != len(tokens):
                return f"turn {i} ({turn.role}): behaviour logprobs must match its token ids"
            if not all(x <= 0 for x in turn.logprobs):
                return f"turn {i} ({turn.role}): behaviour logprobs must be at most 0"
    if t.routed_experts is not None:
        return "routed_experts: a multi-turn trajectory records its routing per turn (turns[i].routed_experts)"
    if bad := misfit(t, arch):
        return f"{bad[0]}: {bad[1]}"
    for k, segment in enumerate(segments(t)):
        if segment.written[0]:
            return f"segment {k} starts with the policy's own tokens: it needs a context to condition on"
        if not any(segment.written):
            return f"segment {k} has no tokens of the policy's own"
    return None
