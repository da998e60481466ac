"""The starter policy: a small Qwen3-MoE built here, deterministically, from local text.

A byte-level BPE tokenizer is trained on the Python standard library's own sources
(present on every machine, so nothing is downloaded), the MoE is initialised from the
seed and mid-trained briefly on the same sources plus a primer of one-line functions in the
coding tasks' shape (`policies/primer.py`), and the result is saved in Hugging
Face format with bf16 weights (a published version is the bf16 rounding of the fp32
master weights) so both vLLM and transformers load it. Built once, then cached: the
build happens in a temporary directory whose last file is a marker holding the hash of
the build arguments, and the directory is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sysconfig
import tempfile
from pathlib import Path

import tokenizers
import torch
import transformers
from rich.progress import Progress
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

import liverl.task_pools as task_pools
import policies.primer as primer

EOS = "<|endoftext|>"
MARKER = "liverl_starter.json"
# Plain-text roles: the model never saw chat data, but vLLM's /v1/chat/completions needs a template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_files(limit: int) -> list[Path]:
    """A fixed, sorted slice of the standard library's top-level Python sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 200_000)
    return files[:limit]


def train_tokenizer(files: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes, nothing is unknown); EOS doubles as BOS and pad."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_stream(files: list[Path], tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """All documents, each followed by EOS, so the model learns to end its text."""
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer(f.read_text(errors="replace"))["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids)


RECIPE = [Path(__file__), Path(primer.__file__), Path(task_pools.__file__)]


def build_key(args: dict[str, int | float | bool]) -> str:
    """Hash of the arguments, the recipe's sources and the libraries that decide the bits."""
    recipe = hashlib.sha256(b"".join(path.read_bytes() for path in RECIPE)).hexdigest()
    identity = dict(args, recipe=recipe,
                    torch=torch.__version__, transformers=transformers.__version__,
                    tokenizers=tokenizers.__version__)
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def build_starter_policy(
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_experts: int = 8,
    top_k: int = 2,
    train_steps: int = 3000,
    corpus_limit: int = 300,
    primer_functions: int = 40000,
    primer_level2_share: float = 0.2,
    tie_embeddings: bool = True,
    progress: bool = True,
) -> Path:
    """Build (or find cached) the starter policy in out_dir; returns out_dir.

    `primer_functions` one-line functions in the coding tasks' shape join the corpus
    (`policies/primer.py`); with `tie_embeddings` the input and output embeddings are one
    matrix during mid-training, so copying a token from the context predicts it for any
    name, not only the ones the primer copied (level 1 at temperature 1: 18.1% tied, 4.1%
    untied; docs/benchmarks.md). The checkpoint is saved untied, as the learner, the delta
    codec and vLLM's weight updates take it."""
    args = dict(seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                num_experts=num_experts, top_k=top_k, train_steps=train_steps, corpus_limit=corpus_limit,
                primer_functions=primer_functions, primer_level2_share=primer_level2_share,
                tie_embeddings=tie_embeddings)
    key = build_key(args)
    marker = out_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("key") == key:
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same filesystem as out_dir, so the final rename is atomic; a unique name, so
    # concurrent builders never write into each other's files.
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".building-", dir=out_dir.parent))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # fixed, so float reductions (and so the weights) do not depend on the machine's cores
    try:
        torch.manual_seed(seed)
        files = corpus_files(corpus_limit)
        tokenizer = train_tokenizer(files, vocab_size)
        config = Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            moe_intermediate_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
            max_position_embeddings=1024, tie_word_embeddings=tie_embeddings,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
        model = Qwen3MoeForCausalLM(config)
        tokens = token_stream(files, tokenizer)
        if primer_functions:
            tokens = torch.cat([tokens, torch.tensor(primer.primer_tokens(tokenizer, primer_functions, primer_level2_share))])
        mid_train(model, tokens, train_steps, seed, progress)
        model.to(torch.bfloat16)
        if tie_embeddings:
            untie(model)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps({"key": key, "args": args}))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def untie(model: Qwen3MoeForCausalLM) -> None:
    """`lm_head` becomes a copy of the embeddings: equal now, free to part in RL."""
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())


def mid_train(model: Qwen3MoeForCausalLM, tokens: torch.Tensor, steps: int, seed: int,
              progress: bool, seq_len: int = 128, batch: int = 16, lr: float = 3e-3) -> None:
    """Next-token prediction on seeded random windows of the corpus; warmup, then cosine decay."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    with Progress(disable=not progress) as bar:
        task = bar.add_task("mid-training the starter policy", total=steps)
        for _ in range(steps):
            starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
            window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
            loss = model(input_ids=window, labels=window).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            bar.update(task, advance=1, description=f"mid-training the starter policy (loss {loss.item():.2f})")
