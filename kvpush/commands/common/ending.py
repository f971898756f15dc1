"""How a command that runs something ends: its report on stdout, then its exit status.

Owns ``finish``: the report as one JSON line (``--json``) or drawn by its view, and the exit
status (interrupted, else 0 when the run did what it should, else 1), for ``drive``, ``demo``
and the ``leg`` commands. Runs on the main thread, last in the command.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import NoReturn, Protocol, TypeVar

import typer
from rich.console import Console, RenderableType

from kvpush.commands.common import stdio
from kvpush.errors import ExitStatus


class Report(Protocol):
    """What ``finish`` prints: a report with a JSON form."""

    def to_dict(self) -> Mapping[str, object]: ...


R = TypeVar("R", bound=Report)


def finish(
    report: R,
    view: Callable[[R], RenderableType],
    json_out: bool,
    *,
    ok: bool,
    interrupted: bool = False,
) -> NoReturn:
    """Print ``report`` (``to_dict()`` as JSON, or ``view(report)``) and exit with its status."""
    if json_out:
        stdio.out(json.dumps(report.to_dict()))
    else:
        Console().print(view(report), soft_wrap=True)
    if interrupted:
        raise typer.Exit(int(ExitStatus.INTERRUPTED))
    raise typer.Exit(0 if ok else 1)
