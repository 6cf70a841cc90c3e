"""Tables that fit the terminal: lesser columns drop out whole, and the columns a user copies from
(a job's id, its state) are never cut or wrapped."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

__all__ = ["ALWAYS", "Column", "fitted_table", "natural_width", "widen"]

# A column that never drops out (and is never wrapped).
ALWAYS = 1_000_000
# Wide enough for any table: the width it is measured at.
_UNBOUNDED = 100_000


@dataclass(frozen=True)
class Column:
    header: str
    keep: int = 0  # the columns with the lowest value drop out first; ALWAYS never does


def _table(title: str, columns: Sequence[tuple[int, Column]], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(title=title)
    for _, column in columns:
        table.add_column(column.header, no_wrap=column.keep >= ALWAYS)
    for row in rows:
        table.add_row(*(row[i] for i, _ in columns))
    return table


def natural_width(console: Console, table: Table) -> int:
    """The cells ``table`` takes with no cell wrapped."""
    return Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum


def fitted_table(
    console: Console,
    title: str,
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    wide: bool = False,
) -> Table:
    """A table of ``rows`` (one string per column) with every column when ``wide``; otherwise the
    most useful columns that fit ``console.width`` without wrapping, and at least the ALWAYS ones;
    a caption says how many columns ``--wide`` would add."""
    kept = list(enumerate(columns))
    while True:
        table = _table(title, kept, rows)
        droppable = [c for c in kept if c[1].keep < ALWAYS]
        if wide or not droppable or natural_width(console, table) <= console.width:
            hidden = len(columns) - len(kept)
            table.caption = f"{hidden} more column{'s' if hidden > 1 else ''}: --wide" if hidden else None
            return table
        kept.remove(min(droppable, key=lambda c: c[1].keep))


def widen(console: Console, tables: Iterable[Table]) -> None:
    """Make ``console`` as wide as the widest table, if wider than it is: lines longer than the
    terminal, no cell cut (what ``--wide`` asks for)."""
    console.width = max(console.width, *(natural_width(console, table) for table in tables))
