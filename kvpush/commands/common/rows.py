"""Label/value lines for the commands' human reports, and the units they print.

``Rows`` lays out label/value lines without table padding (a pipe gets no trailing blanks);
``ibytes`` and ``in_ms`` write sizes and durations; ``TableKw`` names the table keywords a view
adds to a section of ``kvpush.commands.common.live``. Pure; runs on whichever thread prints.
"""

from __future__ import annotations

from typing import TypedDict

from rich.console import Group
from rich.text import Text

from kvpush.commands.common.readings import fmt_ms


class TableKw(TypedDict, total=False):
    """The ``rich.table.Table`` keywords a view adds to ``live.section``'s own."""

    show_header: bool
    collapse_padding: bool
    expand: bool


class Rows:
    """Label/value lines, printed without table padding (no trailing blanks in pipes)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, object]] = []

    def add(self, label: str, value: object) -> None:
        self.rows.append((label, value))

    def render(self) -> Group:
        width = max((len(k) for k, _ in self.rows), default=0)
        lines = []
        for k, v in self.rows:
            value = v if isinstance(v, Text) else Text(str(v))
            lines.append(Text.assemble((k.ljust(width), "dim"), "  ", value))
        return Group(*lines)


def ibytes(n: float) -> str:
    """Binary units for geometry (block sizes are powers of two): 4 KiB, 512 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def in_ms(*figures: tuple[str, float]) -> str:
    """Named durations in seconds, for a person: ``min 0.120 ms · median 0.250 ms``."""
    return " · ".join(f"{name} {fmt_ms(s)} ms" for name, s in figures)
