"""`liverl delta`: lossless deltas between two versions of a safetensors checkpoint."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from sync.checkpoint import Checkpoint
from sync.delta import DeltaError, DeltaManifest, apply_delta_dir, encode_delta, read_manifest

app = typer.Typer(help="Lossless deltas between versions of a Hugging Face safetensors checkpoint.",
                  no_args_is_help=True)
console = Console()
Threads = typer.Option(None, "--threads", "-t", help="Worker threads (default: one per core).")


@app.command()
def encode(
    old_dir: Path = typer.Argument(..., exists=True, help="The base checkpoint directory."),
    new_dir: Path = typer.Argument(..., exists=True, help="The target checkpoint directory."),
    output: Path = typer.Option(..., "--output", "-o", help="The delta file to write."),
    base_version: Optional[str] = typer.Option(None, help="Name of the base (default: OLD_DIR's name)."),
    target_version: Optional[str] = typer.Option(None, help="Name of the target (default: NEW_DIR's name)."),
    threads: Optional[int] = Threads,
) -> None:
    """Write the delta that turns OLD_DIR into NEW_DIR."""
    with _errors():
        new = Checkpoint(new_dir)
        total = sum(new[name].nbytes for name in new)
    with _errors(), _progress("encoding", total) as advance:
        started = time.perf_counter()
        manifest = encode_delta(old_dir, new, output, threads=threads, progress=advance,
                                base_version=base_version or old_dir.resolve().name,
                                target_version=target_version or new_dir.resolve().name)
        seconds = time.perf_counter() - started
    _summary(manifest, output.stat().st_size, seconds)


@app.command()
def apply(
    old_dir: Path = typer.Argument(..., exists=True, help="The base checkpoint directory."),
    delta: Path = typer.Argument(..., exists=True, dir_okay=False, help="The delta file."),
    output: Path = typer.Option(..., "--output", "-o", help="The checkpoint directory to create."),
    expected_base: Optional[str] = typer.Option(
        None, help="Refuse the delta unless it names this base version."),
    threads: Optional[int] = Threads,
) -> None:
    """Rebuild the target checkpoint from OLD_DIR and DELTA into a new directory, bit for bit."""
    with _errors():
        total = read_manifest(delta).nbytes
        with _progress("applying", total) as advance:
            started = time.perf_counter()
            manifest = apply_delta_dir(old_dir, delta, output, expected_base=expected_base,
                                       threads=threads, progress=advance)
            seconds = time.perf_counter() - started
    _summary(manifest, delta.stat().st_size, seconds)
    console.print(f"[green]{output} verified[/green]: digest {manifest.digest[:16]}")


@app.command()
def info(delta: Path = typer.Argument(..., exists=True, dir_okay=False, help="The delta file.")) -> None:
    """Show what a delta contains (its manifest is checked, not its blobs)."""
    with _errors():
        manifest = read_manifest(delta)
    _summary(manifest, delta.stat().st_size, None)


def _summary(manifest: DeltaManifest, delta_bytes: int, seconds: float | None) -> None:
    encodings = Counter(t.encoding for t in manifest.tensors)
    table = Table(show_header=False, box=None)
    for key, value in [
        ("versions", f"{manifest.base_version} -> {manifest.target_version}"),
        ("tensors", ", ".join(f"{n} {e}" for e, n in sorted(encodings.items()))
         + (f", {len(manifest.removed)} removed" if manifest.removed else "")),
        ("values changed", f"{manifest.changed:,} of {manifest.values:,} "
                           f"({manifest.changed / max(manifest.values, 1):.2%})"),
        ("other files", f"{len(manifest.files)} carried, {len(manifest.removed_files)} removed"),
        ("checkpoint", f"{manifest.nbytes / 1e6:,.1f} MB"),
        ("delta", f"{delta_bytes / 1e6:,.2f} MB"),
        ("ratio", f"{manifest.nbytes / max(delta_bytes, 1):.1f}x"),
    ] + ([("time", f"{seconds:.2f} s ({manifest.nbytes / 1e6 / max(seconds, 1e-9):,.0f} MB/s of weights)")]
         if seconds is not None else []):
        table.add_row(f"[bold]{key}[/bold]", value)
    console.print(table)


@contextmanager
def _progress(label: str, total: int):
    columns = [TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda done: progress.advance(task, done)


@contextmanager
def _errors():
    try:
        yield
    except (DeltaError, FileExistsError, FileNotFoundError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from error
