"""The command classes of the ``kvpush`` CLI: typer's, with a flag shown as a flag in ``--help``.

typer's rich help prints a value type beside every option, a flag's included (``--json
<bool>``, ``--verify --no-verify <bool>``, ``--help -h <bool>``), which reads as if the flag
took a value that it refuses (``--json true`` is an extra argument). ``Command`` (each command)
and ``Group`` (the root and ``fleet``) give every flag and the help option an empty metavar, so
the help shows ``--json`` and ``--verify/--no-verify`` alone, as the man page does; parsing and
completion are typer's own.

Imports typer only. Runs on the main thread, when a command's parameters are read.
"""

from __future__ import annotations

from typer import _click as click  # typer >= 0.26 ships its own copy of click
from typer.core import TyperCommand, TyperGroup, TyperOption


def shown_as_flags(params: list[click.Parameter]) -> list[click.Parameter]:
    """``params``, each flag (``--json``, ``--verify/--no-verify``, ``--help``) given no
    metavar, the value type typer would print beside it."""
    for p in params:
        if isinstance(p, TyperOption) and (p.is_flag or p.count) and p.metavar is None:
            p.metavar = ""
    return params


class Command(TyperCommand):
    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return shown_as_flags(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return shown_as_flags(super().get_params(ctx))
