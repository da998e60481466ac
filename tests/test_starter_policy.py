"""The starter policy builds deterministically, loads in transformers, and is cached; the
repository ships it (seed 0), checked against each file's SHA-256 at use."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import policies.starter
from policies.starter import (
    MARKER,
    SHIPPED,
    SUMS,
    StarterMismatch,
    build_starter_policy,
    rebuild_starter,
)

REPO = Path(__file__).resolve().parents[1]
# Tiny but complete: every stage of the real build runs, in seconds.
TINY = dict(seed=7, vocab_size=320, hidden_size=32, num_layers=1, num_experts=4, top_k=2,
            train_steps=3, corpus_limit=12, primer_functions=50, progress=False)


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_starter_policy(tmp_path_factory.mktemp("a") / "starter", **TINY)


def test_same_seed_is_bit_identical_across_processes(built: Path, tmp_path: Path) -> None:
    # A second, fresh process: per-process hash seeds (Python's, the tokenizer's
    # Rust hash maps) must not leak into the result.
    other = tmp_path / "starter"
    code = ("import json, sys; from pathlib import Path; from policies.starter import build_starter_policy; "
            "build_starter_policy(Path(sys.argv[1]), **json.loads(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(other), json.dumps(TINY)], cwd=REPO, check=True)
    assert digests(other) == digests(built)
    assert "model.safetensors" in digests(built) and MARKER in digests(built)


def test_loads_as_a_bf16_qwen3_moe(built: Path) -> None:
    config = AutoConfig.from_pretrained(built)
    assert config.model_type == "qwen3_moe"
    assert config.num_experts == TINY["num_experts"] > config.num_experts_per_tok == TINY["top_k"]
    assert config.dtype == torch.bfloat16
    with safe_open(built / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
        # Tied in mid-training, saved untied (the learner and the delta codec take one
        # tensor per name): the output matrix starts as a copy of the embeddings.
        assert not config.tie_word_embeddings
        assert torch.equal(weights.get_tensor("lm_head.weight"), weights.get_tensor("model.embed_tokens.weight"))

    tokenizer = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == config.eos_token_id
    ids = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "def add(a, b):\n"  # byte-level: lossless round trip
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|assistant|>\n")


def test_second_call_returns_the_cached_build(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a cached starter policy")

    monkeypatch.setattr(policies.starter, "train_tokenizer", no_rebuild)
    assert build_starter_policy(built, **TINY) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before
    # Different arguments are a different policy: the marker no longer matches.
    with pytest.raises(AssertionError, match="rebuilt"):
        build_starter_policy(built, **dict(TINY, seed=8))
    assert not list(built.parent.glob("*.building-*"))  # a failed build leaves no debris


def test_the_defaults_take_the_shipped_starter_verified_without_building(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built the starter the repository ships")

    monkeypatch.setattr(policies.starter, "train_tokenizer", no_build)
    listed = policies.starter.verify(SHIPPED)
    assert set(listed) == set(digests(SHIPPED)) - {SUMS} and "model.safetensors" in listed
    out = build_starter_policy(tmp_path / "starter", progress=False)
    assert digests(out) == {name: sha for name, sha in digests(SHIPPED).items() if name != SUMS}
    assert json.loads((out / MARKER).read_text())["args"] == policies.starter.SHIPPED_ARGS
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert build_starter_policy(out, seed=0, progress=False) == out  # a verified copy is kept as it is
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    (out / "config.json").write_text("{}")  # a spoiled copy is replaced
    assert digests(build_starter_policy(out, progress=False))["config.json"] == listed["config.json"]


def test_a_shipped_file_that_fails_its_sha256_is_refused_in_one_line(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = tmp_path / "starter_model"
    shutil.copytree(SHIPPED, shipped)
    monkeypatch.setattr(policies.starter, "SHIPPED", shipped)
    weights = bytearray((shipped / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (shipped / "model.safetensors").write_bytes(weights)
    with pytest.raises(StarterMismatch) as refused:
        build_starter_policy(tmp_path / "starter", progress=False)
    message = str(refused.value)
    assert "\n" not in message and "model.safetensors" in message
    assert message.endswith("rebuild it with `liverl policy build-starter --seed 0`")
    assert not (tmp_path / "starter").exists()

    # The command line says it in one line too, not a traceback.
    code = ("import sys, pathlib, policies.starter as s; s.SHIPPED = pathlib.Path(sys.argv[1]); "
            "sys.argv = ['liverl', 'policy', 'real-shape', sys.argv[2]]; from app.cli import main; main()")
    env = dict(os.environ, LIVERL_STARTER__CACHE_DIR=str(tmp_path / "cache"), COLUMNS="300")
    run = subprocess.run([sys.executable, "-c", code, str(shipped), str(tmp_path / "real")], cwd=REPO, env=env,
                         check=False, capture_output=True, text=True)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stdout.strip().startswith("error: the starter policy's model.safetensors")
    assert run.stdout.strip().endswith("`liverl policy build-starter --seed 0`") and run.stdout.count("\n") == 1


def test_a_rebuild_writes_the_files_and_their_sha256_and_keeps_the_shipped_folder_for_seed_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = rebuild_starter(tmp_path / "rebuilt", **dict(TINY, progress=True))
    assert policies.starter.verify(out).keys() == set(digests(out)) - {SUMS}
    lines = capsys.readouterr().out.splitlines()  # not a terminal: plain lines, not a bar
    assert lines[0].startswith("building the starter policy from its recipe (seed 7)")
    assert [line.split(",")[0] for line in lines[1:]] == [
        "mid-training the starter policy: step 1 of 3 (33%)", "mid-training the starter policy: step 3 of 3 (100%)"]
    assert not list(tmp_path.glob("*.rebuilding-*"))
    with pytest.raises(ValueError, match="seed 0"):
        rebuild_starter(SHIPPED, **TINY)


def test_build_starter_writes_the_shipped_folder_for_seed_0_and_the_cache_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from app.cli import app

    calls = []
    monkeypatch.setattr(policies.starter, "rebuild_starter", lambda out, **args: calls.append((out, args)))
    monkeypatch.setenv("LIVERL_STARTER__CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    assert runner.invoke(app, ["policy", "build-starter"]).exit_code == 0
    assert runner.invoke(app, ["policy", "build-starter", "--seed", "3"]).exit_code == 0
    assert runner.invoke(app, ["policy", "build-starter", "--seed", "3", "--out", str(tmp_path / "x")]).exit_code == 0
    assert calls == [(SHIPPED, {"seed": 0}), (tmp_path / "cache", {"seed": 3}), (tmp_path / "x", {"seed": 3})]
