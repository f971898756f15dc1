"""The end of an endpoint process: no interpreter finalization once the endpoint has stopped.

Owns ``request`` (the serve command calls it once its endpoint's ordered stop is over) and
``finish`` (the console entry point's last call). After the stop there is nothing left for the
interpreter's finalization to release -- handles, remote agents and memory registrations are
gone, the threads have ended -- yet finalization still runs a full garbage collection over the
~170k objects that torch, numpy and typer create at import, tears down every module and runs
NIXL's and UCX's native destructors: 0.6 s of CPU on this host, which on a 2-core host shared
with other work turned into 18-37 s of wall time between "stopped cleanly" and the process's
exit (measured; docs/reliability.md, "the freeze of issue 16"). A supervisor that gives an
endpoint 20 s to exit after SIGTERM (``kvpush demo``) killed it. ``finish`` flushes what was
written and ends the process with ``os._exit``: the exit status and every line written are
kept, the finalization is skipped. A command that never asked (``drive``, ``probe``, the
library) exits normally. Main thread only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

_requested = False


def request() -> None:
    """The endpoint of this process has stopped in order: end without finalization."""
    global _requested
    _requested = True


def finish(code: int) -> None:
    """Exit with ``code``: at once when ``request``ed (after flushing), else as usual."""
    if not _requested:
        sys.exit(code)
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
