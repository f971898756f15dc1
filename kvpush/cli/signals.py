"""Signal handling of the long-running commands: handlers only set a flag.

Owns ``StopFlag``: SIGINT and SIGTERM set ``event`` (and remember which signal came);
the command's main loop notices and stops in order -- an endpoint drains, drive stops intake
and waits a short grace, demo stops its children and removes its work directory. A second
signal calls ``on_second`` when given (drive: give up the grace) or else exits at once with
status 130. Handlers run on the main thread, between bytecodes; they do no I/O beyond one
write to fd 2.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from kvpush.errors import ExitStatus

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Set by SIGINT/SIGTERM; a second signal forces an immediate exit (status 130)."""

    def __init__(self, on_second: Callable[[], None] | None = None) -> None:
        self.event = threading.Event()
        self.signame = ""
        self._on_second = on_second
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            if self._on_second is not None:
                self._on_second()
                return
            os.write(2, b"kvpush: second signal: exiting without draining\n")
            os._exit(int(ExitStatus.INTERRUPTED))
        self.signame = signal.Signals(signum).name
        self.event.set()

    def install(self, signals: tuple[int, ...] = SIGNALS) -> StopFlag:
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
