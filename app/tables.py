"""Rows (a list of dicts, as the APIs and ClickHouse return them) as a rich table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

console = Console()


def print_rows(rows: list[dict], title: str | None = None, whole: tuple[str, ...] = ()) -> None:
    """`whole`: columns never cut short in a narrow terminal (the others give way)."""
    table = Table(title=title)
    for column in rows[0] if rows else []:
        table.add_column(str(column), no_wrap=column in whole)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(table)
