"""Signal handling of the long-running commands: handlers only set a flag.

Owns ``StopFlag``: SIGINT, SIGTERM and SIGHUP set ``event`` (and remember which signal came);
the command's main loop notices and stops in order -- an endpoint drains, drive stops intake
and waits a short grace, demo stops its children and removes its work directory. A second
signal exits at once with status 130 -- unless the command gave ``on_signal``, which is then
called on every signal instead (drive: the first stops intake, the second ends the grace).
Handlers run on the main thread, between bytecodes; they do no I/O beyond one write to fd 2.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from kvpush.errors import ExitStatus

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopFlag:
    """Set by SIGINT/SIGTERM/SIGHUP; a second signal forces an immediate exit (status 130)."""

    def __init__(self, on_signal: Callable[[], None] | None = None) -> None:
        self.event = threading.Event()
        self.signame = ""
        self._on_signal = on_signal
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._on_signal is not None:
            self.signame = self.signame or signal.Signals(signum).name
            self.event.set()
            self._on_signal()
            return
        if self.event.is_set():
            os.write(2, b"kvpush: second signal: exiting without draining\n")
            os._exit(int(ExitStatus.INTERRUPTED))
        self.signame = signal.Signals(signum).name
        self.event.set()

    def install(self, signals: tuple[int, ...] = SIGNALS) -> StopFlag:
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def rearm(self) -> None:
        """Install the handlers again, keeping the first ``install``'s previous ones: NIXL's UCX
        takes SIGHUP over when an agent starts (its debug signal, ``UCX_DEBUG_SIGNO``)."""
        for sig in self._previous:
            signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
