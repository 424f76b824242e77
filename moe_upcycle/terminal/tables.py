"""Fit a rich table to the terminal: drop optional columns, then switch to a vertical layout.

A table wider than the console is wrapped by rich into narrow columns where dotted tensor names
become ``model.layers…`` and prompts a word per line. `fit` keeps the table when it fits; else it
removes the columns the caller marked optional (least useful first); when it still does not fit
and has more than `MIN_COLUMNS` columns, each row becomes a short block: the first cell as a
heading, then the remaining ``header: value`` pairs, wrapped at the console width between pairs.
Cells are never cut.
"""

from __future__ import annotations

from typing import Sequence

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

MIN_COLUMNS = 3  # up to this many columns, rich's own wrapping stays readable
INDENT, SEP = "  ", "   "


def _width(console: Console, table: Table) -> int:
    wide = console.options.update(width=10**6, max_width=10**6)  # natural width, not capped at the console
    return Measurement.get(console, wide, table).maximum


def _cells(table: Table) -> list[list]:
    """Rows of the table's cells (rich keeps them per column)."""
    columns = [list(c.cells) for c in table.columns]
    return [list(row) for row in zip(*columns)] if columns else []


def _without(table: Table, drop: set[int]) -> Table:
    new = Table(title=table.title, show_header=table.show_header, box=table.box, caption=table.caption)
    keep = [i for i in range(len(table.columns)) if i not in drop]
    for i in keep:
        col = table.columns[i]
        new.add_column(col.header, justify=col.justify, style=col.style, overflow="fold")
    for row in _cells(table):
        new.add_row(*[row[i] for i in keep])
    return new


def vertical(table: Table, width: int) -> RenderableType:
    """Each row as a block: the first cell, then the other ``header: value`` pairs on indented
    lines of at most `width` columns, broken between pairs only."""
    headers = [str(c.header) for c in table.columns]
    parts: list[RenderableType] = []
    if table.title:
        parts.append(Text(str(table.title), style="italic"))
    for row in _cells(table):
        plain = [Text.from_markup(c).plain if isinstance(c, str) else str(c) for c in row]
        parts.append(Text(plain[0], style="bold"))
        line = ""
        for name, value in zip(headers[1:], plain[1:]):
            pair = f"{name}: {value}"
            if line and len(INDENT + line + SEP + pair) > width:
                parts.append(Text(INDENT + line))
                line = pair
            else:
                line = f"{line}{SEP}{pair}" if line else pair
        if line:
            parts.append(Text(INDENT + line))
    return Group(*parts)


def fit(table: Table, console: Console, optional: Sequence[str] = ()) -> RenderableType:
    """The table, narrowed to fit `console` (see the module docstring).

    Args:
        table: a filled table.
        console: where it will be printed (its width decides).
        optional: headers of columns that may be dropped, least useful first.
    """
    if _width(console, table) <= console.width:
        return table
    headers = [str(c.header) for c in table.columns]
    drop: set[int] = set()
    narrowed = table
    for name in optional:
        if name in headers:
            drop.add(headers.index(name))
            narrowed = _without(table, drop)
            if _width(console, narrowed) <= console.width:
                return narrowed
    if len(narrowed.columns) <= MIN_COLUMNS:
        return narrowed
    return vertical(narrowed, console.width)
