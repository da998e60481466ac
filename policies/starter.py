"""The starter policy: a small Qwen3-MoE built here, deterministically, from local text.

A byte-level BPE tokenizer is trained on the Python standard library's own sources
(present on every machine, so nothing is downloaded), the MoE is initialised from the
seed and mid-trained briefly on the same sources plus a primer of one-line functions in the
coding tasks' shape (`policies/primer.py`), and the result is saved in Hugging
Face format with bf16 weights (a published version is the bf16 rounding of the fp32
master weights) so both vLLM and transformers load it. Built once, then cached: the
build happens in a temporary directory whose last file is a marker holding the hash of
the build arguments, and the directory is renamed into place.

The recipe's bits depend on the CPU (float reductions), so the starter itself is shipped:
`policies/starter_model/` holds the recipe's defaults (seed 0) as built once, with the SHA-256
of each file in its `SHA256SUMS`, checked at every use. The defaults take those files;
`liverl policy build-starter` (`rebuild_starter`) builds them anew from the recipe.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Self

import tokenizers
import torch
import transformers
from rich.console import Console
from rich.progress import Progress
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

import liverl.task_pools as task_pools
import policies.primer as primer

EOS = "<|endoftext|>"
MARKER = "liverl_starter.json"
SHIPPED = Path(__file__).with_name("starter_model")  # the starter: the recipe's defaults, built once
SUMS = "SHA256SUMS"  # `sha256sum` format: each shipped file's SHA-256
REBUILD = "liverl policy build-starter --seed 0"
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


def starter_config(tokenizer, hidden_size: int, num_layers: int, num_experts: int, top_k: int,
                   tie_embeddings: bool) -> Qwen3MoeConfig:
    """The starter's architecture: a small Qwen3-MoE over `tokenizer`'s vocabulary."""
    # head_dim: taken at run time (Qwen3MoeConfig keeps extra keywords), not in its typed signature.
    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        max_position_embeddings=1024, tie_word_embeddings=tie_embeddings,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


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
    recipe: bool = False,
) -> Path:
    """Build (or find cached) the starter policy in out_dir; returns out_dir. With the
    recipe's defaults (seed 0) and not `recipe`, the shipped starter, verified, is copied
    there instead (`shipped_starter`): no build.

    `primer_functions` one-line functions in the coding tasks' shape join the corpus
    (`policies/primer.py`); with `tie_embeddings` the input and output embeddings are one
    matrix during mid-training, so copying a token from the context predicts it for any
    name, not only the ones the primer copied (level 1 at temperature 1: 18.1% tied, 4.1%
    untied; docs/history.md). The checkpoint is saved untied, as the learner, the delta
    codec and vLLM's weight updates take it."""
    args = dict(seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                num_experts=num_experts, top_k=top_k, train_steps=train_steps, corpus_limit=corpus_limit,
                primer_functions=primer_functions, primer_level2_share=primer_level2_share,
                tie_embeddings=tie_embeddings)
    if not recipe and args == SHIPPED_ARGS:
        return shipped_starter(out_dir)
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
        model = Qwen3MoeForCausalLM(starter_config(tokenizer, hidden_size, num_layers, num_experts, top_k,
                                                   tie_embeddings))
        tokens = token_stream(files, tokenizer)
        if primer_functions:
            functions = primer.primer_tokens(tokenizer, primer_functions, primer_level2_share)
            tokens = torch.cat([tokens, torch.tensor(functions)])
        if progress:
            print(f"building the starter policy from its recipe (seed {seed}): {len(tokens):,} tokens, "
                  f"{train_steps} steps of mid-training", flush=True)
        mid_train(model, tokens, train_steps, seed, progress)
        model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' wrapper of .to types self as its argument
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


# The shipped starter is the recipe with its defaults, seed 0 among them.
SHIPPED_ARGS = {name: p.default for name, p in inspect.signature(build_starter_policy).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("progress", "recipe")}


class StarterMismatch(RuntimeError):
    """Starter files that differ from their SHA-256: one line, naming the rebuild command."""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(directory: Path) -> dict[str, str]:
    """Each file `SHA256SUMS` lists in `directory` against its SHA-256; {name: sha256}."""
    try:
        lines = (directory / SUMS).read_text().splitlines()
        listed = {name: sha for sha, name in (line.split(maxsplit=1) for line in lines)}
    except (OSError, ValueError):
        raise StarterMismatch(f"the starter policy in {directory} has no readable {SUMS}; "
                              f"rebuild it with `{REBUILD}`") from None
    wrong = sorted(name for name, sha in listed.items()
                   if not (directory / name).is_file() or digest(directory / name) != sha)
    if wrong or not listed:
        raise StarterMismatch(f"the starter policy's {', '.join(wrong) or 'files'} in {directory} "
                              f"differ from {SUMS}; rebuild it with `{REBUILD}`")
    return listed


def shipped_starter(out_dir: Path) -> Path:
    """The shipped starter, verified, in out_dir: copied there unless out_dir holds the same files."""
    listed = verify(SHIPPED)
    if MARKER not in listed or json.loads((SHIPPED / MARKER).read_text()).get("args") != SHIPPED_ARGS:
        raise StarterMismatch(f"the starter policy in {SHIPPED} was built with other arguments than the "
                              f"recipe's defaults; rebuild it with `{REBUILD}`")
    if all((out_dir / name).is_file() and digest(out_dir / name) == sha for name, sha in listed.items()):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".copying-", dir=out_dir.parent))
    for name in listed:
        shutil.copyfile(SHIPPED / name, staging / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def rebuild_starter(out_dir: Path, *, progress: bool = True, **args: Any) -> Path:
    """Build the starter from the recipe anew (no cache, no shipped copy) and put it in
    out_dir with `SHA256SUMS`, the hashes every use checks. `SHIPPED` takes only the
    recipe's defaults; commit what this wrote there to make it the starter."""
    if out_dir.resolve() == SHIPPED.resolve() and dict(SHIPPED_ARGS, **args) != SHIPPED_ARGS:
        raise ValueError(f"{SHIPPED} holds the recipe's defaults (seed 0); write another starter elsewhere")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=out_dir.name + ".rebuilding-", dir=out_dir.parent))
    try:
        built = build_starter_policy(work / "starter", progress=progress, recipe=True, **args)
        (built / SUMS).write_text("".join(f"{digest(path)}  {path.name}\n" for path in sorted(built.iterdir())))
        shutil.rmtree(out_dir, ignore_errors=True)
        built.rename(out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
    with StepProgress("mid-training the starter policy", steps, progress) as bar:
        for _ in range(steps):
            starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
            window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
            loss = model(input_ids=window, labels=window).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            bar.advance(f"loss {loss.item():.2f}")


class StepProgress:
    """A rich progress bar on a terminal; elsewhere (a pipe, a log, CI) a plain line at the
    first step, every `every_s` seconds and at the last, with the time left."""

    def __init__(self, what: str, total: int, enabled: bool = True, every_s: float = 30.0):
        self.what, self.total, self.every_s, self.done = what, total, every_s, 0
        self.plain = enabled and not Console().is_terminal
        self.bar = Progress(disable=not enabled or self.plain)
        self.started = self.said = time.monotonic()

    def __enter__(self) -> Self:
        self.bar.__enter__()
        self.task = self.bar.add_task(self.what, total=self.total)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def advance(self, note: str) -> None:
        self.done += 1
        self.bar.update(self.task, advance=1, description=f"{self.what} ({note})")
        now = time.monotonic()
        if self.plain and (self.done in (1, self.total) or now - self.said >= self.every_s):
            self.said, spent = now, now - self.started
            left = spent / self.done * (self.total - self.done)
            print(f"{self.what}: step {self.done} of {self.total} ({self.done / self.total:.0%}), {note}, "
                  f"{spent / 60:.1f} min so far, about {left / 60:.1f} min left", flush=True)
