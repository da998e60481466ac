"""The starter policy builds deterministically, loads in transformers, and is cached."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import policies.starter
from policies.starter import MARKER, build_starter_policy

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
