"""Router replay on served traffic (issue 45): the replicas return the experts each MoE layer
routed every token to, the trajectory carries them to the learner through the gateway, the
feedback join and the samples topic, and the learner's training step runs exactly those
experts, also where its own fp32 router would have chosen others.

Whole and streamed answers alike (the replica's server adds a chunk carrying the routing
before a stream's end: serving/replica_server.py). One bf16 replica is started for this (one
engine start, about 40 s): the stack's replicas compute in fp32 like the learner and agree
with it almost everywhere, which proves nothing about replay, but it proves the capture is
aligned (token i, layer l is token i, layer l)."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers import item, stable_pinned, wait_for

from learner import router_replay
from learner.trainer import Trainer, collate
from liverl.contracts import RewardedSample, RoutedExperts, Topics
from liverl.kafka import read_topic
from liverl.pool import Replica, edit_pool, read_pool, replica_lock
from liverl.process import stop_pid
from liverl.settings import LearnerConfig, Settings
from policies.registry import Registry
from serving.swap import VerificationFailed, verify

# A shared prefix longer than a KV block (128 tokens on CPU), so later requests read it from
# the prefix cache, and their routing there from vLLM's block store; prompts of 243-248
# tokens, so that 24 more cross into a third block while decoding.
PREFIX = "def fibonacci(n):\n    # the nth number of the sequence\n" * 12
SUFFIXES = ("    return 1", "    if n < 2:", "    a, b = 0, 1", "    x = [0]", "    while n:")


def served_routing(choice: dict) -> np.ndarray:
    """The routing a replica answered with (vLLM's field: base64 of a .npy)."""
    return np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)


def complete(settings: Settings, key: str, prompt: str, stream: bool = False) -> dict:
    """A completion through the gateway, asking for its routing; streamed, its chunks put
    together as a whole answer's one choice."""
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 1.0, "return_routed_experts": True,
            "stream": stream}
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        if not stream:
            response = client.post(settings.url(settings.ports.gateway) + "/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()
        with client.stream("POST", settings.url(settings.ports.gateway) + "/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert all(c["index"] == 0 for c in choices)
    routing = [c["routed_experts"] for c in choices if "routed_experts" in c]
    assert len(routing) == 1, "one chunk carries the routing, before [DONE]"
    return {"completion_id": chunks[0]["completion_id"], "streamed": True,
            "choices": [{"text": "".join(c.get("text", "") for c in choices), "routed_experts": routing[0]}]}


def accept_and_join(settings: Settings, api: httpx.Client, answers: list[dict]) -> list[RewardedSample]:
    """Each answer accepted by its user; the rewarded samples the join emits for them."""
    ids = {a["completion_id"] for a in answers}
    batch = [item(f"f-{uuid.uuid4().hex}", {"kind": "accept", "completion_id": i}) for i in ids]
    assert api.post("/v1/ingestion", json={"batch": batch}).status_code < 300

    def joined() -> list[RewardedSample] | None:
        samples = [RewardedSample.model_validate_json(raw) for raw in read_topic(settings, Topics.SAMPLES)]
        mine = {s.trajectory.completion_id: s for s in samples if s.trajectory.completion_id in ids}
        return list(mine.values()) if len(mine) == len(ids) else None

    return wait_for(joined, timeout=90, interval=1.0)


@pytest.fixture(scope="module")
def bf16_replica(settings: Settings, stack, tmp_path_factory):
    """One replica of the starter computing in bf16 (the stack's compute in fp32), its KV cache
    cut to 6 blocks of 128 tokens so that concurrent requests preempt each other. The starter,
    not the suite's stable: how far a trained version's bf16 probe reads from fp32 depends on
    the versions the suite happened to train (0.347 once, 0.945 at a v30, past the 16-bit
    tolerance), the starter's does not (0.049)."""
    from transformers import AutoTokenizer

    from liverl.probe import PROBE_FILE, probe_logprobs
    from liverl.process import spawn
    from serving.replicas import replica_command, replica_env, replica_url, wait_replica

    starter = tmp_path_factory.mktemp("bf16") / "starter"  # with the probe a version carries
    shutil.copytree(settings.starter.model_dir, starter)
    (starter / PROBE_FILE).write_text(json.dumps(probe_logprobs(starter, AutoTokenizer.from_pretrained(starter))))
    bf16 = settings.model_copy(update={"serving": settings.serving.model_copy(update={"dtype": "bfloat16"})})
    url = replica_url(settings, 7)
    process = spawn([*replica_command(bf16, starter, url), "--num-gpu-blocks-override", "6"],
                    replica_env(bf16), settings.run_dir / "replica-7-bf16.log")
    replica = Replica(name="replica-7", url=url, policy_version="v0", model_dir=str(starter), pid=process.pid)
    try:
        wait_replica(bf16, replica, process)
        yield replica
    finally:
        stop_pid(process.pid, timeout=60)  # its engine too (a wait for the server alone timed out in CI)


def preemptions(url: str) -> float:
    from liverl.pool import replica_client

    with replica_client(url) as http:
        return float(re.search(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+]+)$", http.get("/metrics").text,
                               re.M).group(1))


@contextlib.contextmanager
def only_replica(settings: Settings, replica: Replica) -> Iterator[None]:
    """While the block runs, general traffic goes to `replica` alone, and the controller
    leaves the pool as the test set it: stable is pinned (or its `serve_stable_everywhere`
    swaps `replica`, which serves the starter, onto stable: CI, Nov 29), and the replicas
    taken out are locked, as a swap under way holds them (or its `restore_abandoned` puts
    them back in rotation)."""
    with stable_pinned(settings, "the router-capture test owns the replicas"), contextlib.ExitStack() as held:
        others = [r.name for r in read_pool(settings).general if r.enabled]
        for name in others:
            held.enter_context(replica_lock(settings, name))
        try:
            with edit_pool(settings) as pool:
                pool.replicas = [r.model_copy(update={"enabled": False}) if r.name in others else r
                                 for r in pool.replicas] + [replica]
            yield
        finally:
            with edit_pool(settings) as pool:
                pool.replicas = [r.model_copy(update={"enabled": True}) if r.name in others else r
                                 for r in pool.replicas if r.name != replica.name]


def learner_step(model_dir: Path, samples: list[RewardedSample]):
    """The learner's own training step (fp32, router replay on) on `samples`: the batch it
    collated, and the routing its routers recomputed and used in that step's forward."""
    trainer = Trainer(model_dir, LearnerConfig(minibatch=len(samples), lr=1e-4))
    batch = collate(samples, trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
    stats = trainer.step(samples, trainer.advantages(samples), list(range(len(samples))), 0, None, None)
    recomputed = router_replay.recomputed_routing(trainer.model)
    used = router_replay.used_routing(trainer.model)
    return batch, stats, recomputed, used


def test_the_learner_trains_through_the_experts_a_bf16_replica_routed_to(settings, api, dev_keys, paused_learner,
                                                                         bf16_replica):
    key = dev_keys["tenant_key"]
    stable = Registry(settings.policies_dir).stable()
    assert stable is not None
    starter = Path(bf16_replica.model_dir)
    aligned = complete(settings, key, PREFIX + "    pass")  # an fp32 replica of the stack
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        plain = client.post(settings.url(settings.ports.gateway) + "/v1/completions",
                            json={"prompt": PREFIX + "    pass", "max_tokens": 4, "stream": True})
    assert plain.status_code == 200 and "[DONE]" in plain.text
    assert "routed_experts" not in plain.text  # a client that did not ask sees plain OpenAI chunks
    with only_replica(settings, bf16_replica):
        first = complete(settings, key, PREFIX + SUFFIXES[0])  # computes the prefix's blocks

        def burst() -> list[dict]:
            together = threading.Barrier(8)  # sent at once, so that they share the 6 blocks

            def concurrent_complete(suffix: str, stream: bool) -> dict:
                together.wait(timeout=60)
                return complete(settings, key, PREFIX + suffix, stream)

            with concurrent.futures.ThreadPoolExecutor(8) as pool:  # half of them streamed
                return list(pool.map(concurrent_complete, SUFFIXES[1:] * 2, [False] * 4 + [True] * 4))

        # The scheduler preempts only requests that run together, which a busy machine can
        # spread out: up to three bursts, until one was preempted and computed again.
        answers = [first]
        for _ in range(3):
            answers += burst()
            if preemptions(bf16_replica.url) > 0:
                break
    # The swap's probe holds a bf16 replica of the right weights to the 16-bit tolerance, which
    # passes it, not fp32's, which it reads about 500x over (docs/benchmarks.md).
    assert verify(bf16_replica.url, starter, settings.learner.probe_tolerance_for("bfloat16")) > 0
    with pytest.raises(VerificationFailed):
        verify(bf16_replica.url, starter, settings.learner.probe_tolerance_for("float32"))
    # 8 requests at once, 2 blocks each to start (one shared) and a third to finish, in 6 blocks:
    # some were preempted and computed again.
    assert preemptions(bf16_replica.url) > 0
    plain_id = plain.headers["x-liverl-completion-id"]
    samples = {s.trajectory.completion_id: s
               for s in accept_and_join(settings, api, [aligned, *answers, {"completion_id": plain_id}])}
    assert samples[plain_id].trajectory.routed_experts is not None  # ...and its trajectory has them

    # What the learner received is what the replica answered, token for token and layer for layer.
    for answer in [aligned, *answers]:
        choice = answer["choices"][0]
        t = samples[answer["completion_id"]].trajectory
        assert t.routed_experts is not None and t.routed_experts.dtype == "uint8"
        assert np.array_equal(t.routed_experts.array(), served_routing(choice))
        assert t.routed_experts.shape[0] == len(t.prompt_token_ids) + len(t.completion_token_ids) - 1
    # Requests sharing the prefix got the same routing there, the later ones from the cache's blocks.
    prefix = [samples[a["completion_id"]].trajectory.routed_experts.array()[:128] for a in answers]
    assert all(np.array_equal(prefix[0], p) for p in prefix[1:])

    # The fp32 replica and the fp32 learner agree (the capture is aligned with the tokens)...
    batch, _, recomputed, _ = learner_step(Path(stable.model_dir), [samples[aligned["completion_id"]]])
    assert router_replay.routing_mismatch(recomputed, batch.routing, batch.attention) < 0.01

    # ...the bf16 replica and the fp32 learner do not, and the learner follows the replica.
    served = [samples[a["completion_id"]] for a in answers]
    batch, stats, recomputed, used = learner_step(starter, served)
    routing = batch.routing
    assert routing is not None
    known = (routing >= 0).all(-1) & batch.attention.reshape(1, -1).bool()  # [layers, tokens]
    assert known.sum() == sum(s.trajectory.routed_experts.shape[0] for s in served) * routing.shape[0]
    assert torch.equal(used[known], routing[known])  # every recorded token and layer: the replica's experts
    differs = known & (recomputed.sort(-1).values != routing.sort(-1).values).any(-1)
    assert differs.any(), "bf16 serving and fp32 training chose the same experts everywhere"
    assert torch.equal(used[differs], routing[differs])
    assert stats.replayed_mismatch == 0.0 and 0.0 < stats.recomputed_mismatch < 0.2
    # Each request's routing is its own: another prompt's would agree with the learner at chance.
    for r in range(len(served)):
        rows = slice(r * batch.input_ids.shape[1], (r + 1) * batch.input_ids.shape[1])
        row_known = known[:, rows]
        agree = ~differs[:, rows] & row_known
        assert agree.sum() / row_known.sum() > 0.8


def test_routing_is_stored_compactly():
    """A served routing record for the starter's 3 layers, top-2 of 8: uint8, compressed."""
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(3 * 400)]).reshape(400, 3, 2)
    record = RoutedExperts.of(ids)
    assert record.dtype == "uint8" and np.array_equal(record.array(), ids)
    assert len(record.model_dump_json()) / 400 < 6 * 1.1 + 1  # under a raw uint8 byte per id, base64 and all
    with pytest.raises(ValueError, match="not a uint8 array"):
        RoutedExperts(shape=(401, 3, 2), dtype="uint8", zstd=record.zstd)


def test_a_multi_turn_episode_gives_each_turn_its_rows_of_the_segments_routing():
    """An episode's segment is sent whole with each turn; the routing its latest completion
    returned (vLLM's .npy, all but the last token) is split over the segment's turns, and the
    learner's segment gets it back end to end."""
    from learner.segments import UNKNOWN, segments
    from liverl.contracts import Trajectory, Turn
    from rollouts.episode import with_routing

    turns = [Turn(role="user", token_ids=[1, 2, 3]), Turn(role="assistant", token_ids=[4, 5], logprobs=[-1.0] * 2),
             Turn(role="tool", token_ids=[6]), Turn(role="assistant", token_ids=[7, 8], logprobs=[-1.0] * 2)]
    rows = np.arange(7 * 3 * 2, dtype=np.uint8).reshape(7, 3, 2)  # 8 tokens: the last was never read
    answer = io.BytesIO()
    np.save(answer, rows)
    routed = with_routing(turns, 0, base64.b64encode(answer.getvalue()).decode())
    assert [t.routed_experts.shape[0] for t in routed] == [3, 2, 1, 1]
    t = Trajectory(event_id="e", tenant="t", completion_id="c", policy_version="v0", turns=routed)
    (segment,) = segments(t)
    assert np.array_equal(segment.routed_experts[:7], rows) and (segment.routed_experts[7] == UNKNOWN).all()
