"""Lossless policy deltas: liverl's codec against the field's schemes, on the same tensors.

    .venv/bin/python benchmarks/bench_delta.py synthetic [--layers 10] [--lr 1e-6 --lr 1e-5]
    .venv/bin/python benchmarks/bench_delta.py dirs OLD_DIR NEW_DIR

`synthetic` builds a Qwen3-MoE-shaped model (10 layers of 16 experts: 1.25B parameters)
with fp32 master weights, takes one Adam step at each learning rate from the same
weights and gradients, and compares the published bf16 roundings. `dirs` compares two
Hugging Face checkpoint directories, e.g. consecutive versions written by the learner.

For each pair it prints the order-0 entropy of the change (the integer difference of the
bit patterns) and, per scheme, the delta's size, its ratio to the checkpoint, that ratio
as a share of the entropy bound, and encode and decode throughput in MB of weights per
second, all on one core (torch, zstd and zipnn are held to one thread; liverl is also
run on every core): per second of wall-clock time, and per CPU-second of the process
(all its threads), which is the per-core figure that holds on a machine shared with
other work. Every decoded tensor is compared bit for bit with the target.

Schemes: the full checkpoint; XOR + zstd-1 as slime's disk-delta sync does it (XOR of
each tensor's bytes with the previous version, unchanged tensors skipped, zstd level 1,
a blake3 checksum of each new tensor checked after decoding); zipnn's delta (XOR, then
byte grouping and Huffman), if the `zipnn` package is installed; liverl's codec.
"""

from __future__ import annotations

import ctypes
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import blake3
import numpy as np
import torch
import typer
import zstandard
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sync import Checkpoint, encode_delta, iter_apply
from sync.checkpoint import bits
from sync.codec import keep_freed_memory

app = typer.Typer(help=__doc__.split("\n\n")[0], no_args_is_help=True)
console = Console(width=180)  # wide enough for the table in a log file
Tensors = Mapping[str, torch.Tensor]
Threads = typer.Option(None, help="Threads of liverl's all-cores run (default: one per core).")
Repeats = typer.Option(2, help="Passes per scheme; the best time counts.")


@dataclass
class Row:
    scheme: str
    delta_bytes: int
    encode_s: float | None = None
    decode_s: float | None = None
    exact: bool | None = None
    threads: int = 1
    encode_cpu_s: float | None = None  # CPU time of the process (all its threads)
    decode_cpu_s: float | None = None


# --- the change and its entropy --------------------------------------------------------------
def comparable(old: Tensors, name: str, new: torch.Tensor) -> torch.Tensor | None:
    base = old.get(name)
    return base if base is not None and base.dtype == new.dtype and base.shape == new.shape else None


def change_stats(old: Tensors, new: Tensors, progress: Progress) -> tuple[int, int, float]:
    """(values, changed values, order-0 entropy in bits of the whole change), the entropy
    summed over dtypes, each with its own histogram of bit-pattern differences."""
    histograms: dict[str, Counter] = {}
    values = changed = 0
    task = progress.add_task("entropy of the change", total=len(new))
    for name, tensor in new.items():
        base = comparable(old, name, tensor)
        difference = bits(tensor) - (bits(base) if base is not None else 0)
        values, changed = values + difference.size, changed + int(np.count_nonzero(difference))
        unsigned = difference.view(difference.dtype.str.replace("i", "u"))
        if unsigned.itemsize <= 2:  # dense histogram, far faster than np.unique
            counts = np.bincount(unsigned, minlength=1 << (8 * unsigned.itemsize))
            keys = np.flatnonzero(counts)
            histograms.setdefault(str(tensor.dtype), Counter()).update(dict(zip(keys.tolist(), counts[keys].tolist())))
        else:
            keys, counts = np.unique(unsigned, return_counts=True)
            histograms.setdefault(str(tensor.dtype), Counter()).update(dict(zip(keys.tolist(), counts.tolist())))
        progress.advance(task)
    entropy_bits = 0.0
    for histogram in histograms.values():
        counts = np.array(list(histogram.values()), np.float64)
        entropy_bits -= float((counts * np.log2(counts / counts.sum())).sum())
    return values, changed, entropy_bits


# --- the schemes -----------------------------------------------------------------------------------
# A scheme is a pair of closures over (old, new): encode() keeps its delta and returns its
# size in bytes; decode() yields (name, bit pattern array) for every target tensor.
Scheme = tuple[str, Callable[[], int], Callable[[], Iterator[tuple[str, np.ndarray]]]]


def xor_zstd(old: Tensors, new: Tensors, tick: Callable[[], None]) -> Scheme:
    compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    payload: dict[str, tuple[bytes, str]] = {}

    def encode() -> int:
        payload.clear()
        for name, tensor in new.items():
            base = comparable(old, name, tensor)
            raw = bits(tensor).view(np.uint8)
            xor = raw ^ bits(base).view(np.uint8) if base is not None else raw
            if base is None or np.count_nonzero(xor):
                payload[name] = compressor.compress(xor), blake3.blake3(raw).hexdigest()
            tick()
        return sum(len(blob) for blob, _ in payload.values())

    def decode() -> Iterator[tuple[str, np.ndarray]]:
        for name, tensor in new.items():
            base = comparable(old, name, tensor)
            if name in payload:
                blob, checksum = payload[name]
                result = np.frombuffer(decompressor.decompress(blob), np.uint8)
                result = result ^ bits(base).view(np.uint8) if base is not None else result
                assert blake3.blake3(result).hexdigest() == checksum, f"{name}: checksum mismatch"
            else:
                result = bits(base)
            tick()
            yield name, result

    return "XOR + zstd-1 (slime, SkyRL, NeMo-RL)", encode, decode


def zipnn_delta(old: Tensors, new: Tensors, tick: Callable[[], None]) -> Scheme | None:
    try:
        import zipnn
    except ImportError:
        console.print("[yellow]zipnn is not installed: its row is left out[/yellow]")
        return None
    kinds = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    delta = {d: zipnn.ZipNN(input_format="byte", bytearray_dtype=k, threads=1, delta_compressed_type="byte")
             for d, k in kinds.items()}
    plain = {d: zipnn.ZipNN(input_format="byte", bytearray_dtype=k, threads=1) for d, k in kinds.items()}
    payload: dict[str, bytes] = {}
    raw = lambda tensor: memoryview(bits(tensor).view(np.uint8))  # noqa: E731

    def encode() -> int:
        payload.clear()
        for name, tensor in new.items():
            base = comparable(old, name, tensor)
            if base is None:
                payload[name] = plain[tensor.dtype].compress(raw(tensor))
            elif not np.array_equal(bits(base), bits(tensor)):
                payload[name] = delta[tensor.dtype].compress(raw(tensor), delta_second_data=raw(base))
            tick()
        return sum(map(len, payload.values()))

    def decode() -> Iterator[tuple[str, np.ndarray]]:
        for name, tensor in new.items():
            base = comparable(old, name, tensor)
            if name not in payload:
                result = bits(base)
            elif base is None:
                result = np.frombuffer(plain[tensor.dtype].decompress(payload[name]), np.uint8)
            else:
                result = np.frombuffer(delta[tensor.dtype].decompress(payload[name], delta_second_data=raw(base)),
                                       np.uint8)
            tick()
            yield name, result

    return "zipnn delta (XOR, byte grouping, Huffman)", encode, decode


def liverl(old: Tensors, new: Tensors, tick: Callable[[], None], threads: int, path: Path) -> Scheme:
    def encode() -> int:
        with open(path, "wb") as f:  # a stream: into the page cache, no fsync, like the others' memory
            encode_delta(old, new, f, base_version="a", target_version="b", threads=threads,
                         progress=lambda _: tick())
        return path.stat().st_size

    def decode() -> Iterator[tuple[str, np.ndarray]]:
        for entry, tensor in iter_apply(old, path, expected_base="a", threads=threads):
            tick()
            yield entry.name, bits(tensor)

    return f"liverl codec, {threads} thread{'s' if threads > 1 else ''}", encode, decode


def measure(scheme: Scheme, new: Tensors, repeats: int, threads: int = 1) -> Row:
    """Best of `repeats` encode and decode times (the first pass also pays for memory the
    process never touched before, which in a VM costs more than the decoding itself).
    A timed decode drops each tensor as it comes out, so memory stays at the tensors in
    flight; one more, untimed, decode then compares every tensor bit for bit with the
    target (decoding is deterministic: it is the same output)."""
    name, encode, decode = scheme
    row = Row(name, 0, math.inf, math.inf, True, threads, math.inf, math.inf)
    for _ in range(repeats):
        started, cpu = time.perf_counter(), time.process_time()
        row.delta_bytes = encode()
        row.encode_s = min(row.encode_s, time.perf_counter() - started)
        row.encode_cpu_s = min(row.encode_cpu_s, time.process_time() - cpu)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in decode():
            pass
        row.decode_s = min(row.decode_s, time.perf_counter() - started)
        row.decode_cpu_s = min(row.decode_cpu_s, time.process_time() - cpu)
    names = []
    for decoded_name, result in decode():
        names.append(decoded_name)
        row.exact &= np.array_equal(result.view(np.uint8), bits(new[decoded_name]).view(np.uint8))
    row.exact &= names == list(new)
    return row


# --- the comparison ----------------------------------------------------------------------------
def compare(title: str, old: Tensors, new: Tensors, all_threads: int, repeats: int, targets: bool = False) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()  # liverl's malloc setting, for every scheme alike
    nbytes = sum(t.nbytes for t in new.values())
    with _progress() as progress, tempfile.TemporaryDirectory() as tmp:
        values, changed, entropy_bits = change_stats(old, new, progress)
        bound = nbytes * 8 / max(entropy_bits, 1e-9)
        rows = [Row("full checkpoint", nbytes)]
        for make in [xor_zstd, zipnn_delta] + [
                partial(liverl, threads=t, path=Path(tmp) / "delta") for t in sorted({1, all_threads})]:
            task = progress.add_task("", total=(2 * repeats + 1) * len(new))
            scheme = make(old, new, lambda: progress.advance(task))
            if scheme:
                progress.update(task, description=scheme[0])
                threads = make.keywords["threads"] if isinstance(make, partial) else 1
                rows.append(measure(scheme, new, repeats, threads))
    console.print(f"\n[bold]{title}[/bold]: {values:,} values in {len(new)} tensors, {nbytes / 1e6:,.0f} MB; "
                  f"{changed / values:.2%} changed; order-0 entropy of the change "
                  f"{entropy_bits / values:.3f} bits/value, bound {bound:.1f}x")
    table = Table()
    for column in ["scheme", "delta MB", "ratio", "% of bound", "encode MB/s", "decode MB/s",
                   "encode MB/CPU-s", "decode MB/CPU-s", "bit-exact"]:
        table.add_column(column, justify="left" if column == "scheme" else "right")
    for row in rows:
        ratio = nbytes / row.delta_bytes
        speed = lambda s: "" if s is None else f"{nbytes / 1e6 / s:,.0f}"  # noqa: E731
        table.add_row(row.scheme, f"{row.delta_bytes / 1e6:,.1f}", f"{ratio:.2f}x", f"{ratio / bound:.1%}",
                      speed(row.encode_s), speed(row.decode_s),
                      speed(row.encode_cpu_s), speed(row.decode_cpu_s),
                      "" if row.exact is None else "yes" if row.exact else "[red]NO[/red]")
    console.print(table)
    if not targets:
        return
    ours = next(row for row in rows if row.scheme.startswith("liverl") and row.threads == 1)
    xor = next(row for row in rows if row.scheme.startswith("XOR"))
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    console.print(f"liverl, one core: {nbytes / ours.delta_bytes / bound:.1%} of the entropy bound "
                  f"(target 85%: {met(nbytes / ours.delta_bytes >= 0.85 * bound)}), "
                  f"{xor.delta_bytes / ours.delta_bytes:.2f}x the ratio of XOR + zstd; "
                  f"encode {nbytes / 1e6 / ours.encode_s:,.0f} MB/s wall, {nbytes / 1e6 / ours.encode_cpu_s:,.0f} "
                  f"MB/CPU-s; decode {nbytes / 1e6 / ours.decode_s:,.0f} MB/s wall, "
                  f"{nbytes / 1e6 / ours.decode_cpu_s:,.0f} MB/CPU-s (target 500 per core, wall: "
                  f"{met(min(nbytes / 1e6 / ours.encode_s, nbytes / 1e6 / ours.decode_s) >= 500)}, CPU time: "
                  f"{met(min(nbytes / 1e6 / ours.encode_cpu_s, nbytes / 1e6 / ours.decode_cpu_s) >= 500)}); "
                  f"bit-exact: {met(all(row.exact is not False for row in rows))}")


# --- the synthetic model ------------------------------------------------------------------------------
def qwen3_moe_shapes(layers: int, hidden: int = 2048, experts: int = 16, expert_ffn: int = 1024,
                     heads: int = 16, kv_heads: int = 4, head_dim: int = 128, vocab: int = 32768):
    """(name, shape, init std) of a Qwen3-MoE-style model; norms are ones."""
    yield "model.embed_tokens.weight", (vocab, hidden), 0.02
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (hidden,), None
        for name, rows in [("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)]:
            yield f"{p}.self_attn.{name}.weight", (rows, hidden), 0.02
        yield f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim), 0.02
        yield f"{p}.self_attn.q_norm.weight", (head_dim,), None
        yield f"{p}.self_attn.k_norm.weight", (head_dim,), None
        yield f"{p}.post_attention_layernorm.weight", (hidden,), None
        yield f"{p}.mlp.gate.weight", (experts, hidden), 0.02
        for e in range(experts):
            yield f"{p}.mlp.experts.{e}.gate_proj.weight", (expert_ffn, hidden), 0.02
            yield f"{p}.mlp.experts.{e}.up_proj.weight", (expert_ffn, hidden), 0.02
            yield f"{p}.mlp.experts.{e}.down_proj.weight", (hidden, expert_ffn), 0.02
    yield "model.norm.weight", (hidden,), None
    yield "lm_head.weight", (vocab, hidden), 0.02


def adam_steps(layers: int, lrs: list[float], seed: int) -> tuple[Tensors, dict[float, Tensors]]:
    """The bf16 rounding of fp32 master weights before and after one Adam step per lr
    (same weights, same gradient); one tensor at a time, so only bf16 copies stay."""
    shapes = list(qwen3_moe_shapes(layers))
    base, stepped = {}, {lr: {} for lr in lrs}
    # Map every block above 1 MB fresh from the kernel while generating: the fp32
    # temporaries of each step then go back on free instead of fragmenting the heap
    # between the bf16 copies that stay (5 GB more at 1.25B parameters).
    _mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    with _progress() as progress:
        task = progress.add_task("synthetic model: Adam steps", total=sum(math.prod(s) for _, s, _ in shapes))
        for i, (name, shape, std) in enumerate(shapes):
            generator = torch.Generator().manual_seed(seed * 100_003 + i)
            master = torch.randn(shape, generator=generator) * std if std else torch.ones(shape)
            gradient = torch.randn(shape, generator=generator)
            base[name] = master.bfloat16()
            for lr in lrs:
                weight = torch.nn.Parameter(master.clone())
                weight.grad = gradient
                torch.optim.Adam([weight], lr=lr).step()
                stepped[lr][name] = weight.detach().bfloat16()
            progress.advance(task, math.prod(shape))
    keep_freed_memory.__wrapped__()  # back to the codec's setting for the measurements
    return base, stepped


@app.command()
def synthetic(layers: int = typer.Option(10, help="MoE layers (10: 1.25B parameters)."),
              lr: list[float] = typer.Option([1e-6, 1e-5], help="Adam learning rates (repeatable)."),
              seed: int = 0, threads: Optional[int] = Threads, repeats: int = Repeats) -> None:
    """A synthetic MoE stepped by Adam, published in bf16."""
    for rate in lr:
        # One learning rate at a time (the same seed gives the same weights and gradient),
        # so only two bf16 copies of the model are held: 5 GB at 1.25B parameters.
        torch.set_num_threads(os.cpu_count() or 1)  # generation only; measurements use one
        base, stepped = adam_steps(layers, [rate], seed)
        _release_freed_memory()
        params = sum(t.numel() for t in base.values())
        compare(f"synthetic Qwen3-MoE, {params / 1e9:.2f}B parameters, one Adam step at lr {rate:g}",
                base, stepped[rate], threads or os.cpu_count() or 1, repeats, targets=True)
        del base, stepped
        _release_freed_memory()


def _mallopt(parameter: int, value: int) -> None:
    try:
        ctypes.CDLL(None).mallopt(parameter, value)
    except (OSError, AttributeError):  # not glibc
        pass


def _release_freed_memory() -> None:
    """Give the fp32 temporaries of the generation back to the system: freed between the
    bf16 copies that stay, glibc would otherwise keep them (gigabytes at 1B parameters)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@app.command()
def dirs(old_dir: Path = typer.Argument(..., exists=True), new_dir: Path = typer.Argument(..., exists=True),
         threads: Optional[int] = Threads, repeats: int = Repeats) -> None:
    """Two checkpoint directories, e.g. consecutive policy versions."""
    compare(f"{old_dir} -> {new_dir}", Checkpoint(old_dir), Checkpoint(new_dir), threads or os.cpu_count() or 1,
            repeats)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


if __name__ == "__main__":
    app()
