"""`liverl delta`: lossless deltas between two versions of a safetensors checkpoint;
`liverl sync`: how versions reach the replicas through the delta store."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from sync.checkpoint import Checkpoint
from sync.delta import (
    FORMATS,
    LATEST_FORMAT,
    DeltaError,
    DeltaManifest,
    apply_delta_dir,
    encode_delta,
    read_manifest,
)

app = typer.Typer(help="Lossless deltas between versions of a Hugging Face safetensors checkpoint.",
                  no_args_is_help=True)
sync_app = typer.Typer(help="Delta transport to the replicas: status and retention.", no_args_is_help=True)
console = Console()
Threads = typer.Option(None, "--threads", "-t", help="Worker threads (default: one per core).")


@app.command()
def encode(
    old_dir: Path = typer.Argument(..., exists=True, help="The base checkpoint directory."),
    new_dir: Path = typer.Argument(..., exists=True, help="The target checkpoint directory."),
    output: Path = typer.Option(..., "--output", "-o", help="The delta file to write."),
    base_version: str | None = typer.Option(None, help="Name of the base (default: OLD_DIR's name)."),
    target_version: str | None = typer.Option(None, help="Name of the target (default: NEW_DIR's name)."),
    threads: int | None = Threads,
    format: int = typer.Option(LATEST_FORMAT, "--format", min=min(FORMATS), max=max(FORMATS),
                               help="Delta format (1 for replicas that read no other)."),
) -> None:
    """Write the delta that turns OLD_DIR into NEW_DIR."""
    with _errors():
        new = Checkpoint(new_dir)
        total = sum(new[name].nbytes for name in new)
    with _errors(), _progress("encoding", total) as advance:
        started = time.perf_counter()
        manifest = encode_delta(old_dir, new, output, threads=threads, progress=advance, format=format,
                                base_version=base_version or old_dir.resolve().name,
                                target_version=target_version or new_dir.resolve().name)
        seconds = time.perf_counter() - started
    _summary(manifest, output.stat().st_size, seconds)


@app.command()
def apply(
    old_dir: Path = typer.Argument(..., exists=True, help="The base checkpoint directory."),
    delta: Path = typer.Argument(..., exists=True, dir_okay=False, help="The delta file."),
    output: Path = typer.Option(..., "--output", "-o", help="The checkpoint directory to create."),
    expected_base: str | None = typer.Option(
        None, help="Refuse the delta unless it names this base version."),
    threads: int | None = Threads,
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
        ("format", str(manifest.format)),
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


# --- liverl sync ---------------------------------------------------------------------------
DataDir = typer.Option(None, "--data-dir", envvar="LIVERL_DATA_DIR", help="State directory.")


@sync_app.command("status")
def sync_status(data_dir: Path | None = DataDir) -> None:
    """Each replica's version, what is pending, bytes shipped and the ratio achieved;
    then what the delta store holds."""
    from liverl.manifest import running_settings
    from liverl.pool import read_pool
    from sync.records import read_records, sync_store
    from sync.replica import replica_states

    settings = running_settings(data_dir)
    states = replica_states(settings)
    pool = {r.name: r for r in read_pool(settings).replicas}
    table = Table(title=f"replicas (transport: {settings.sync.transport})")
    for column in ("replica", "serving", "local", "pending", "last transfer", "shipped", "ratio", "error"):
        table.add_column(column)
    for name in dict.fromkeys(list(pool) + list(states)):
        replica, state = pool.get(name), states.get(name)
        last = state.last if state else None
        table.add_row(
            name, replica.policy_version if replica else "-",
            ", ".join(v for v in (state.held, state.previous) if v) if state else "-",
            (state.pending if state else None) or "-",
            f"{last.base or 'snapshot'} -> {last.version}: {len(last.objects)} objects" if last else "-",
            f"{state.fetched_bytes / 1e6:,.2f} MB" if state else "-",
            f"{state.weights_bytes / max(state.fetched_bytes, 1):.1f}x" if state and state.fetched_bytes else "-",
            (state.error if state else None) or "")
    console.print(table)
    store = Table(title=f"delta store ({settings.delta_store.kind})")
    for column in ("version", "parent", "weights", "delta", "snapshot", "delta ratio"):
        store.add_column(column)
    for record in sorted(read_records(sync_store(settings)).values(), key=lambda r: r.seq):
        store.add_row(record.version, record.parent or "-", f"{record.nbytes / 1e6:,.2f} MB",
                      f"{record.delta.size / 1e6:,.3f} MB" if record.delta else "-",
                      f"{record.snapshot.size / 1e6:,.2f} MB" if record.snapshot else "-",
                      f"{record.nbytes / record.delta.size:.1f}x" if record.delta else "-")
    console.print(store)


@sync_app.command("gc")
def sync_gc(data_dir: Path | None = DataDir) -> None:
    """Remove store objects and registry weights older than `sync.keep_versions` that no
    replica, alias or rollback target needs."""
    from liverl.manifest import running_settings
    from policies.registry import Registry
    from sync.records import sync_store
    from sync.retention import collect_garbage

    settings = running_settings(data_dir)
    result = collect_garbage(settings, sync_store(settings), Registry(settings.policies_dir))
    console.print(f"kept {len(result.kept)} versions ({', '.join(result.kept) or 'none'}); "
                  f"removed {len(result.removed)} objects; full weights removed from the registry: "
                  f"{', '.join(result.weights_removed) or 'none'}")
    for key in result.removed:
        console.print(f"  removed {key}")
