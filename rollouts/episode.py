"""One multi-turn episode on a replica: the policy's turns and the environment's replies in
one growing context of token ids, and a summary whenever the next turn might not fit.

Every piece is placed in the context as token ids (the replica's own `/tokenize`), so the
recorded turns are exactly what the policy read and wrote, and the learner rebuilds each
context token for token (learner/segments.py). The context never passes `limit` tokens
(at most the replicas' `max_model_len`): before each turn the episode checks that the turn
and a later summary still fit; if not, it appends the environment's summary request, the
policy writes a summary, and a fresh context starts from the task and that summary. A
tool reply is cut to the room that leaves, as an agent harness truncates long tool output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import httpx

from liverl.contracts import WRITTEN_ROLES, RoutedExperts, Turn
from liverl.pool import SERVED_MODEL_NAME
from liverl.settings import RolloutsConfig
from rollouts.environment import MultiTurnEnvironment, Task


class Cut(Exception):
    """A request of the episode did not complete (the replica was taken back, or failed)."""


class Misconfigured(ValueError):
    """The settings cannot run this environment's episodes: no group can succeed."""


@dataclass
class Episode:
    turns: list[Turn]
    final: str  # the last attempt's text: what the environment scores
    summaries: int

    @property
    def written_tokens(self) -> int:
        return sum(len(t.token_ids or []) for t in self.turns if t.role in WRITTEN_ROLES)


async def tokenize(client: httpx.AsyncClient, text: str, first: bool = False) -> list[int]:
    """`text` as the served tokenizer splits it; special tokens (BOS) only at a context's start."""
    try:
        response = await client.post("/tokenize", json={"model": SERVED_MODEL_NAME, "prompt": text,
                                                         "add_special_tokens": first})
    except httpx.TransportError as error:
        raise Cut(repr(error)) from error
    if response.status_code != 200:
        raise Cut(f"/tokenize answered {response.status_code}")
    return response.json()["tokens"]


async def generate(client: httpx.AsyncClient, context: list[int], max_tokens: int, config: RolloutsConfig,
                   task: Task, still_lent: Callable[[], bool]) -> dict[str, Any]:
    """One turn of the policy after `context`: its text, token ids and behaviour logprobs.
    Asked only while the replica is still lent on the episode's version: a take-back aborts
    the requests in flight, and this stops the ones an episode would send after it."""
    if not still_lent():
        raise Cut("the replica was taken back or moved to another version")
    try:
        response = await client.post("/v1/completions", json={
            "model": SERVED_MODEL_NAME, "prompt": context, "max_tokens": max_tokens,
            "temperature": config.temperature, "logprobs": 0, "return_token_ids": True,
            "stop": list(task.stop) or None})
    except httpx.TransportError as error:
        raise Cut(repr(error)) from error
    if response.status_code != 200:
        raise Cut(f"/v1/completions answered {response.status_code}")
    choice = response.json()["choices"][0]
    if choice.get("finish_reason") == "abort":
        raise Cut("aborted")
    return {"text": choice.get("text") or "", "token_ids": choice.get("token_ids") or [],
            "logprobs": [lp for lp in (choice.get("logprobs") or {}).get("token_logprobs") or [] if lp is not None],
            "routing": choice.get("routed_experts")}


def with_routing(turns: list[Turn], start: int, routing: str | None) -> list[Turn]:
    """`turns`, those of the segment from `start` given the routing the replica returned with
    the segment's latest completion: it covers the segment from its first token (the prefix
    cache keeps each block's routing as it was computed), each turn takes its tokens' rows."""
    if routing is None:
        return turns
    rows = RoutedExperts.model_validate(routing).array()
    out, at = turns[:start], 0
    for turn in turns[start:]:
        mine = rows[at: at + len(turn.token_ids or [])]
        out.append(turn.model_copy(update={"routed_experts": RoutedExperts.of(mine)}) if len(mine) else turn)
        at += len(turn.token_ids or [])
    return out


@dataclass
class Frame:
    """What every episode of a task shares, tokenized once per group."""

    task: list[int]  # the first context
    request: list[int]  # the summary request
    before: str  # a fresh context's text around a summary, and its tokens
    after: str
    resume_before: list[int]
    resume_after: list[int]


async def frame(client: httpx.AsyncClient, environment: MultiTurnEnvironment, task: Task,
                config: RolloutsConfig, limit: int) -> Frame:
    """The task's pieces as token ids; `Misconfigured` if a fresh context, a turn and a
    summary cannot fit in `limit`."""
    before, after = environment.resume(task)
    pieces = Frame(await tokenize(client, task.prompt, first=True), await tokenize(client, environment.summary_request),
                   before, after, await tokenize(client, before, first=True), await tokenize(client, after))
    needed = (len(pieces.resume_before) + config.summary_tokens + len(pieces.resume_after) + config.max_tokens
              + len(pieces.request) + config.summary_tokens)
    if needed > limit:
        raise Misconfigured(f"rollouts.context_tokens: {limit} tokens cannot hold a resumed context, a turn and "
                            f"a summary ({needed} tokens for this task); raise it or lower max_tokens/summary_tokens")
    return pieces


async def play(client: httpx.AsyncClient, environment: MultiTurnEnvironment, task: Task, pieces: Frame,
               config: RolloutsConfig, limit: int, still_lent: Callable[[], bool], tools: Executor) -> Episode:
    """The episode's turns, from the task to the environment's end (raises `Cut`); the
    environment's tool runs on `tools`."""
    request, before, after = pieces.request, pieces.before, pieces.after
    resume_before, resume_after = pieces.resume_before, pieces.resume_after
    summary_room = len(request) + config.summary_tokens
    context = list(pieces.task)
    turns = [Turn(role="user", content=task.prompt, token_ids=list(context))]
    attempts: list[str] = []
    summaries, segment_start = 0, 0
    while len(attempts) < environment.max_turns:
        if len(context) + config.max_tokens + summary_room > limit:
            turns.append(Turn(role="user", content=environment.summary_request, token_ids=request))
            written = await generate(client, context + request, config.summary_tokens, config, task, still_lent)
            if not written["token_ids"]:
                raise Cut("the replica wrote an empty summary")
            turns.append(Turn(role="summary", content=written["text"], token_ids=written["token_ids"],
                              logprobs=written["logprobs"],
                              summarizes_turns=list(range(segment_start, len(turns) - 1))))
            turns = with_routing(turns, segment_start, written["routing"])
            context = resume_before + written["token_ids"] + resume_after
            segment_start = len(turns)
            turns.append(Turn(role="user", content=before + written["text"] + after, token_ids=list(context)))
            summaries += 1
        written = await generate(client, context, config.max_tokens, config, task, still_lent)
        if not written["token_ids"]:
            raise Cut("the replica wrote an empty turn")
        turns.append(Turn(role="assistant", content=written["text"], token_ids=written["token_ids"],
                          logprobs=written["logprobs"]))
        context += written["token_ids"]
        attempts.append(written["text"])
        # The environment's tool (a sandbox run) blocks: off the event loop the other groups share.
        reply = await asyncio.get_running_loop().run_in_executor(tools, environment.respond, task, list(attempts))
        if reply is None:
            break
        # The reply is cut to what leaves room for a summary request and a summary.
        if tokens := (await tokenize(client, reply))[: max(0, limit - len(context) - summary_room)]:
            turns.append(Turn(role="tool", content=reply, token_ids=tokens))
            context += tokens
    return Episode(with_routing(turns, segment_start, written["routing"]), attempts[-1], summaries)
