"""stdout and stderr that survive their reader going away.

Owns ``install`` (wrap ``sys.stdout``/``sys.stderr`` once, at the start of ``main``) and
``stdout_closed``. A write to a pipe whose reader exited (``kvpush probe P | grep -q healthy``,
``kvpush serve-decode -o json | head -1``) raises ``BrokenPipeError``; the wrapper swallows it,
points the file descriptor at ``/dev/null`` (so the interpreter's own flush at exit is quiet
too) and remembers it: a command goes on to its real exit status, an endpoint goes on serving.
Every thread may write; the flag is a plain bool set once.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO, cast


class PipeSafe:
    """A text stream whose writes never raise ``BrokenPipeError``."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def _broke(self) -> None:
        self.broken = True
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, self._stream.fileno())
            os.close(fd)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, OSError):  # EPIPE; EIO from a hung-up terminal
                self._broke()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, OSError):
                self._broke()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def install() -> None:
    """Wrap stdout and stderr (idempotent)."""
    if not isinstance(sys.stdout, PipeSafe):
        sys.stdout = cast(TextIO, PipeSafe(sys.stdout))  # a proxy of the stream it wraps
    if not isinstance(sys.stderr, PipeSafe):
        sys.stderr = cast(TextIO, PipeSafe(sys.stderr))


def stdout_closed() -> bool:
    """True once a write found stdout's reader gone."""
    return isinstance(sys.stdout, PipeSafe) and sys.stdout.broken


def out(text: str = "", end: str = "\n") -> None:
    """Write a line to stdout (no colour, no markup) and flush it."""
    sys.stdout.write(text + end)
    sys.stdout.flush()


def err(text: str = "", end: str = "\n") -> None:
    """Write a line to stderr (no colour, no markup) and flush it."""
    sys.stderr.write(text + end)
    sys.stderr.flush()
