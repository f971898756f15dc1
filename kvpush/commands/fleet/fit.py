"""Fleet tables that fit the terminal: columns dropped by priority, never the ones that say who.

Owns ``Column`` (a header, its alignment and when it is dropped: 0 never, else the higher the
sooner) and ``fitted`` (a ``section`` table of the given rows that is at most ``width`` columns
wide, built with the fewest columns dropped; ``width`` None: a pipe, nothing dropped and nothing
cut). The columns that name an endpoint -- its role and its whole ``HOST:PORT`` -- and a pair's
outcome are never dropped nor shortened; the serve live view condenses the same way. Also
``chunks`` (the matrix's D columns split into groups that fit). Pure rendering on the caller's
thread; measures with an off-screen console.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, RenderableType
from rich.table import Table

from kvpush.commands.common.live import section

_MEASURE = Console(file=io.StringIO(), width=100_000, color_system=None)


@dataclass(frozen=True)
class Column:
    name: str
    right: bool = False
    drop: int = 0  # 0: never dropped; otherwise the highest is dropped first


def width_of(r: RenderableType) -> int:
    """How wide ``r`` draws when nothing limits it."""
    return _MEASURE.measure(r).maximum


def _table(
    title: str, cols: Sequence[Column], rows: Sequence[Sequence[RenderableType]], keep: list[int]
) -> Table:
    t = section(title)
    for i in keep:
        c = cols[i]
        t.add_column(c.name, justify="right" if c.right else "left", no_wrap=True)
    for row in rows:
        t.add_row(*(row[i] for i in keep))
    return t


def fitted(
    title: str,
    cols: Sequence[Column],
    rows: Sequence[Sequence[RenderableType]],
    width: int | None,
) -> Table:
    """The table with the fewest columns dropped that is at most ``width`` wide (the never
    dropped columns are kept whatever the width)."""
    keep = list(range(len(cols)))
    order = sorted((i for i, c in enumerate(cols) if c.drop), key=lambda i: -cols[i].drop)
    while True:
        t = _table(title, cols, rows, keep)
        if width is None or not order or _width_of_table(t) <= width:
            return t
        keep.remove(order.pop(0))


def _width_of_table(t: Table) -> int:
    title, t.title = t.title, None  # a long title wraps; the columns are what must fit
    try:
        return width_of(t)
    finally:
        t.title = title


def chunks(first: int, widths: Sequence[int], width: int | None) -> list[range]:
    """Consecutive groups of columns (of ``widths``, each plus its padding) that fit beside a
    first column ``first`` wide in ``width`` (None: one group)."""
    if width is None or not widths:
        return [range(len(widths))]
    out: list[range] = []
    start, used = 0, first
    for i, w in enumerate(widths):
        if i > start and used + w + 2 > width:
            out.append(range(start, i))
            start, used = i, first
        used += w + 2
    out.append(range(start, len(widths)))
    return out
