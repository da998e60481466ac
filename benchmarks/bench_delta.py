"""Lossless policy deltas: liverl's codec against the field's schemes, on the same tensors.

    .venv/bin/python benchmarks/bench_delta.py synthetic [--layers 10] [--lr 1e-6 --lr 1e-5] [--steps 20]
    .venv/bin/python benchmarks/bench_delta.py dirs OLD_DIR NEW_DIR

`synthetic` builds a Qwen3-MoE-shaped model (10 layers of 16 experts: 1.25B parameters)
with fp32 master weights and compares the published bf16 roundings of two versions at
each learning rate: with `--steps 1`, before and after one Adam step (it moves every
weight by about +-lr: the best case for integer differences, the worst for XOR); with
`--steps 20`, the warmed-up case: per tensor, Adam with default betas for 20 steps on
gradients that are a fixed normal component plus fresh normal noise, versions after
steps 19 and 20. `dirs` compares two Hugging Face checkpoint directories, e.g.
consecutive versions written by the learner.

For each pair it prints two bounds on the change (the integer difference of the bit
patterns, one histogram per dtype): the order-0 entropy, and the context bound, its
entropy given the base value's exponent (`context_entropy`: the yardstick of issue 15,
fixed, whatever context the codec uses). Per scheme: the delta's size, its ratio to the
checkpoint, that ratio as a share of each bound, and encode and decode throughput in MB
of weights per second, all on one core (torch, zstd and zipnn are held to one thread;
liverl is also run on every core): per second of wall-clock time, and per CPU-second of
the process (all its threads), which is the per-core figure that holds on a machine
shared with other work. Every decoded tensor is compared bit for bit with the target.

Schemes: the full checkpoint; XOR + zstd-1 as slime's disk-delta sync does it (XOR of
each tensor's bytes with the previous version, unchanged tensors skipped, zstd level 1,
a blake3 checksum of each new tensor checked after decoding); zipnn's delta (XOR, then
byte grouping and Huffman), if the `zipnn` package is installed; liverl's codec in
format 1 (chunks coded on their own) and format 2 (each change given the base).
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

import blake3
import numpy as np
import torch
import typer
import zstandard
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sync import Checkpoint, encode_delta, iter_apply
from sync.checkpoint import bits, dtype_name
from sync.codec import FLOAT_LAYOUT, keep_freed_memory
from sync.delta import FORMATS

app = typer.Typer(help=__doc__.split("\n\n")[0], no_args_is_help=True)
console = Console(width=180)  # wide enough for the table in a log file
Tensors = Mapping[str, torch.Tensor]
Threads = typer.Option(None, help="Threads of liverl's all-cores run (default: one per core).")
Repeats = typer.Option(2, help="Passes per scheme; the best time counts.")


@dataclass
class Change:
    values: int
    changed: int
    order0_bits: float  # order-0 entropy of the whole change
    context_bits: float  # its entropy given the base value's exponent


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


def change_stats(old: Tensors, new: Tensors, progress: Progress) -> Change:
    """The change's size and its two bounds, each summed over dtypes with histograms of
    bit-pattern differences per dtype (and per base exponent for the context bound)."""
    order0: dict[str, Counter] = {}
    context: dict[str, Counter] = {}
    values = changed = 0
    task = progress.add_task("entropy of the change", total=len(new))
    for name, tensor in new.items():
        base = comparable(old, name, tensor)
        difference = bits(tensor) - (bits(base) if base is not None else 0)
        values, changed = values + difference.size, changed + int(np.count_nonzero(difference))
        unsigned = difference.view(difference.dtype.str.replace("i", "u"))
        dtype = str(tensor.dtype)
        order0.setdefault(dtype, Counter()).update(_histogram(unsigned))
        exponents = context_of(dtype_name(tensor.dtype), bits(base) if base is not None else None, unsigned.size)
        context.setdefault(dtype, Counter()).update(_histogram(unsigned, exponents))
        progress.advance(task)
    return Change(values, changed, sum(map(_entropy, order0.values())), sum(map(_entropy, context.values())))


def context_of(dtype: str, base: np.ndarray | None, size: int) -> np.ndarray:
    """The context bound's context, defined once for issue 15 and not to be moved: the
    base value's exponent (the bits of its magnitude above the mantissa); one context
    for types without an exponent and for tensors new to the base."""
    if base is None or dtype not in FLOAT_LAYOUT:
        return np.zeros(size, np.int64)
    return (base & np.iinfo(base.dtype).max).astype(np.int64) >> FLOAT_LAYOUT[dtype][1]


def _histogram(unsigned: np.ndarray, contexts: np.ndarray | None = None) -> dict:
    """Counts of each difference (of each (context, difference) pair)."""
    if contexts is None and unsigned.itemsize <= 2:  # dense histogram, far faster than np.unique
        counts = np.bincount(unsigned, minlength=1 << (8 * unsigned.itemsize))
        keys = np.flatnonzero(counts)
        return dict(zip(keys.tolist(), counts[keys].tolist(), strict=True))
    if contexts is None:
        keys, counts = np.unique(unsigned, return_counts=True)
        return dict(zip(keys.tolist(), counts.tolist(), strict=True))
    # Unchanged values counted per context; only the changed ones go through a sort.
    unchanged = np.bincount(contexts[unsigned == 0])
    histogram = {(int(c), 0): int(n) for c, n in enumerate(unchanged) if n}
    moved = np.flatnonzero(unsigned)
    if unsigned.itemsize <= 4:  # one integer key per pair: a flat sort, far faster than rows
        keys, counts = np.unique((contexts[moved] << 32) | unsigned[moved], return_counts=True)
        pairs = zip((keys >> 32).tolist(), (keys & 0xFFFFFFFF).tolist(), strict=True)
    else:
        rows = np.stack([contexts[moved], unsigned[moved].view(np.int64)], axis=1)
        keys, counts = np.unique(rows, axis=0, return_counts=True)
        pairs = map(tuple, keys.tolist())
    histogram.update(zip(pairs, counts.tolist(), strict=True))
    return histogram


def _entropy(histogram: Counter) -> float:
    """Bits to code every counted symbol, order 0, given its context if keys are pairs."""
    groups: dict = {}
    for key, count in histogram.items():
        groups.setdefault(key[0] if isinstance(key, tuple) else None, []).append(count)
    total = 0.0
    for counts in groups.values():
        array = np.array(counts, np.float64)
        total -= float((array * np.log2(array / array.sum())).sum())
    return total


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


def liverl(old: Tensors, new: Tensors, tick: Callable[[], None], threads: int, path: Path, format: int) -> Scheme:
    def encode() -> int:
        with open(path, "wb") as f:  # a stream: into the page cache, no fsync, like the others' memory
            encode_delta(old, new, f, base_version="a", target_version="b", threads=threads,
                         progress=lambda _: tick(), format=format)
        return path.stat().st_size

    def decode() -> Iterator[tuple[str, np.ndarray]]:
        for entry, tensor in iter_apply(old, path, expected_base="a", threads=threads):
            tick()
            yield entry.name, bits(tensor)

    return f"liverl format {format}, {threads} thread{'s' if threads > 1 else ''}", encode, decode


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
    # liverl: the previous format on one core, the latest on one and on every core.
    runs = [(FORMATS[0], 1)] + [(FORMATS[-1], t) for t in sorted({1, all_threads})]
    with _progress() as progress, tempfile.TemporaryDirectory() as tmp:
        change = change_stats(old, new, progress)
        order0, context = (nbytes * 8 / max(b, 1e-9) for b in (change.order0_bits, change.context_bits))
        rows = [Row("full checkpoint", nbytes)]
        for make in [xor_zstd, zipnn_delta] + [
                partial(liverl, threads=t, format=f, path=Path(tmp) / "delta") for f, t in runs]:
            task = progress.add_task("", total=(2 * repeats + 1) * len(new))
            scheme = make(old, new, lambda task=task: progress.advance(task))
            if scheme:
                progress.update(task, description=scheme[0])
                threads = make.keywords["threads"] if isinstance(make, partial) else 1
                rows.append(measure(scheme, new, repeats, threads))
    console.print(f"\n[bold]{title}[/bold]: {change.values:,} values in {len(new)} tensors, {nbytes / 1e6:,.0f} MB; "
                  f"{change.changed / change.values:.2%} changed; entropy of the change "
                  f"{change.order0_bits / change.values:.3f} bits/value order 0 (bound {order0:.1f}x), "
                  f"{change.context_bits / change.values:.3f} given the base's exponent (context bound {context:.1f}x)")
    table = Table()
    for column in ["scheme", "delta MB", "ratio", "% of order-0 bound", "% of context bound", "encode MB/s",
                   "decode MB/s", "encode MB/CPU-s", "decode MB/CPU-s", "bit-exact"]:
        table.add_column(column, justify="left" if column == "scheme" else "right")
    for row in rows:
        ratio = nbytes / row.delta_bytes
        speed = lambda s: "" if s is None else f"{nbytes / 1e6 / s:,.0f}"  # noqa: E731
        table.add_row(row.scheme, f"{row.delta_bytes / 1e6:,.1f}", f"{ratio:.2f}x", f"{ratio / order0:.1%}",
                      f"{ratio / context:.1%}", speed(row.encode_s), speed(row.decode_s),
                      speed(row.encode_cpu_s), speed(row.decode_cpu_s),
                      "" if row.exact is None else "yes" if row.exact else "[red]NO[/red]")
    console.print(table)
    if targets:
        print_targets(rows, nbytes, context)


def print_targets(rows: list[Row], nbytes: int, context: float) -> None:
    """Issue 15's targets for the latest format on one core: 85% of the context bound,
    decode 500 and encode 250 MB of weights per second, bit-exact."""
    ours = next(row for row in rows if row.scheme.startswith(f"liverl format {FORMATS[-1]}") and row.threads == 1)
    xor = next(row for row in rows if row.scheme.startswith("XOR"))
    previous = next(row for row in rows if row.scheme.startswith(f"liverl format {FORMATS[0]}"))
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    mb = nbytes / 1e6
    console.print(f"liverl format {FORMATS[-1]}, one core: {nbytes / ours.delta_bytes / context:.1%} of the context "
                  f"bound (target 85%: {met(nbytes / ours.delta_bytes >= 0.85 * context)}), "
                  f"{xor.delta_bytes / ours.delta_bytes:.2f}x the ratio of XOR + zstd, "
                  f"{previous.delta_bytes / ours.delta_bytes:.2f}x that of format {FORMATS[0]}; "
                  f"encode {mb / ours.encode_s:,.0f} MB/s wall, {mb / ours.encode_cpu_s:,.0f} MB/CPU-s (target 250: "
                  f"{met(mb / max(ours.encode_s, ours.encode_cpu_s) >= 250)}); decode {mb / ours.decode_s:,.0f} MB/s "
                  f"wall, {mb / ours.decode_cpu_s:,.0f} MB/CPU-s (target 500: "
                  f"{met(mb / max(ours.decode_s, ours.decode_cpu_s) >= 500)}); "
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


def adam_versions(layers: int, lr: float, steps: int, seed: int) -> tuple[Tensors, Tensors]:
    """The bf16 roundings of fp32 master weights after Adam steps `steps - 1` and `steps`
    (step 0: the initial weights). One step: on a normal gradient; more: on gradients
    that are a fixed normal component plus fresh normal noise. One tensor at a time, so
    only the bf16 copies stay."""
    shapes = list(qwen3_moe_shapes(layers))
    old, new = {}, {}
    # Map every block above 1 MB fresh from the kernel while generating: the fp32
    # temporaries of each step then go back on free instead of fragmenting the heap
    # between the bf16 copies that stay (5 GB more at 1.25B parameters).
    _mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    with _progress() as progress:
        task = progress.add_task(f"synthetic model: {steps} Adam step(s) at lr {lr:g}",
                                 total=sum(math.prod(s) for _, s, _ in shapes))
        for i, (name, shape, std) in enumerate(shapes):
            generator = torch.Generator().manual_seed(seed * 100_003 + i)
            master = torch.randn(shape, generator=generator) * std if std else torch.ones(shape)
            fixed = torch.randn(shape, generator=generator)
            weight = torch.nn.Parameter(master)
            optimizer = torch.optim.Adam([weight], lr=lr)
            for step in range(1, steps + 1):
                if step == steps:
                    old[name] = weight.detach().bfloat16()
                weight.grad = fixed if steps == 1 else fixed + torch.randn(shape, generator=generator)
                optimizer.step()
            new[name] = weight.detach().bfloat16()
            progress.advance(task, math.prod(shape))
    keep_freed_memory.__wrapped__()  # back to the codec's setting for the measurements
    return old, new


@app.command()
def synthetic(layers: int = typer.Option(10, help="MoE layers (10: 1.25B parameters)."),
              lr: list[float] = typer.Option([1e-6, 1e-5], help="Adam learning rates (repeatable)."),
              steps: int = typer.Option(1, min=1, help="Compare the versions after these Adam steps and the one "
                                                       "before (1: the first step; 20: the warmed-up case)."),
              seed: int = 0, threads: int | None = Threads, repeats: int = Repeats) -> None:
    """A synthetic MoE stepped by Adam, published in bf16."""
    for rate in lr:
        # One learning rate at a time, so only two bf16 copies of the model are held:
        # 5 GB at 1.25B parameters.
        torch.set_num_threads(os.cpu_count() or 1)  # generation only; measurements use one
        old, new = adam_versions(layers, rate, steps, seed)
        _release_freed_memory()
        params = sum(t.numel() for t in new.values())
        case = "one Adam step" if steps == 1 else f"Adam steps {steps - 1} -> {steps}"
        compare(f"synthetic Qwen3-MoE, {params / 1e9:.2f}B parameters, {case} at lr {rate:g}",
                old, new, threads or os.cpu_count() or 1, repeats, targets=True)
        del old, new
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
         threads: int | None = Threads, repeats: int = Repeats) -> None:
    """Two checkpoint directories, e.g. consecutive policy versions."""
    compare(f"{old_dir} -> {new_dir}", Checkpoint(old_dir), Checkpoint(new_dir), threads or os.cpu_count() or 1,
            repeats)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


if __name__ == "__main__":
    app()
