"""Rows (a list of dicts, as the APIs and ClickHouse return them) as a rich table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

console = Console()


def print_rows(rows: list[dict], title: str | None = None) -> None:
    table = Table(title=title)
    for i, column in enumerate(rows[0] if rows else []):
        table.add_column(str(column), no_wrap=i == 0)  # the first column names the row: never cut
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(table)
