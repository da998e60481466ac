"""What the learner trains of a policy: LoRA through peft, a named subset, the whole; and
the refusal of a mode that cannot fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed_learner import sampled

import learner.trainer as trainer_module
from learner.trainer import Trainer
from liverl.probe import PROBE_FILE, probe_logprobs
from liverl.settings import LearnerConfig, LoraConfig

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate.weight")


def changed_tensors(before: Path, after: Path) -> set[str]:
    old, new = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    assert old.keys() == new.keys()  # the same checkpoint layout: replicas swap it in place
    return {name for name in old if not torch.equal(old[name], new[name])}


def test_a_lora_version_publishes_merged_weights_that_change_only_what_is_adapted(starter_dir: Path,
                                                                                  tmp_path: Path):
    trainer = Trainer(starter_dir, LearnerConfig(lora=LoraConfig(rank=4, alpha=8), lr=1e-2, minibatch=4))
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert set(trainer.snapshot()) == trained  # the parent is the adapters, not a model copy
    trainer.train(sampled(starter_dir, count=8))
    trainer.export(tmp_path / "v1")

    changed = changed_tensors(starter_dir, tmp_path / "v1")
    assert changed and all(any(a in name for a in ADAPTED) for name in changed), changed
    assert any("mlp.gate" in name for name in changed)  # the routers learn too
    # The probe made on the model in memory is the one a fresh load of the export gives.
    written = json.loads((tmp_path / "v1" / PROBE_FILE).read_text())["probes"]
    loaded = probe_logprobs(tmp_path / "v1", trainer.tokenizer)["probes"]
    for mine, theirs in zip(written, loaded, strict=True):
        assert mine["token_ids"] == theirs["token_ids"]
        assert max(abs(a - b) for a, b in zip(mine["logprobs"], theirs["logprobs"], strict=True)) < 1e-5


def test_a_lora_learner_resumes_its_adapters_and_refuses_a_state_of_another_mode(starter_dir: Path,
                                                                                 tmp_path: Path):
    config = LearnerConfig(lora=LoraConfig(rank=4, alpha=8), lr=1e-2, minibatch=4)
    trainer = Trainer(starter_dir, config)
    trainer.train(sampled(starter_dir, count=4))
    trainer.save_state(tmp_path / "v1.pt")
    resumed = Trainer(starter_dir, config, tmp_path / "v1.pt")
    for name, weight in trainer.snapshot().items():
        assert torch.equal(resumed.snapshot()[name], weight)
    with pytest.raises(ValueError, match="LORA or __FROZEN_PARAMETERS changed"):
        Trainer(starter_dir, LearnerConfig(), tmp_path / "v1.pt")


def test_lora_and_a_frozen_subset_are_not_asked_for_together():
    with pytest.raises(ValueError, match="FROZEN_PARAMETERS has nothing to freeze"):
        LearnerConfig(lora=LoraConfig(), frozen_parameters=["experts"])


def test_a_frozen_subset_keeps_no_copy_of_what_does_not_train(starter_dir: Path):
    trainer = Trainer(starter_dir, LearnerConfig(frozen_parameters=["embed_tokens", "lm_head", "experts"]))
    parent = trainer.snapshot()
    assert parent and not any(part in n for n in parent for part in ("embed_tokens", "lm_head", "experts"))


def test_a_mode_that_cannot_fit_is_refused_naming_what_would(starter_dir: Path, monkeypatch):
    full = Trainer(starter_dir, LearnerConfig())
    weights = sum(p.numel() for p in full.model.parameters())
    # Room for the fp32 weights and a little more: full training's Adam state does not fit, LoRA's does.
    monkeypatch.setattr(trainer_module, "available_memory", lambda: weights * 4 + weights)
    with pytest.raises(ValueError, match=r"the learner needs about .* GiB .* LoRA rank 16 .* needs about"):
        Trainer(starter_dir, LearnerConfig())
    Trainer(starter_dir, LearnerConfig(lora=LoraConfig()))
