"""Signal handling of the long-running commands: handlers only set a flag.

Owns ``StopFlag``: SIGINT, SIGTERM and SIGHUP set ``event`` (and remember which signal came);
the command's main loop notices and stops in order -- an endpoint drains, drive stops intake
and waits a short grace, demo stops its children and removes its work directory. A second
signal exits at once with status 130 -- unless the command gave ``on_signal``, which is then
called on every signal instead (drive: the first stops intake, the second ends the grace).
Handlers run on the main thread, between bytecodes, and take no lock (see ``StopFlag``): a
relay thread sets the flag and calls ``on_signal``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

from kvpush.errors import ExitStatus

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What ``signal.signal`` hands back: a callable, SIG_DFL/SIG_IGN, or None (not set from Python).
_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class StopFlag:
    """Set by SIGINT/SIGTERM/SIGHUP; a second signal forces an immediate exit (status 130).

    The handler takes no lock. Python runs it on the main thread between two bytecodes, and
    that thread may hold a lock at that moment: the one of ``event`` itself while it is inside
    ``event.wait()`` -- ``Condition.wait`` holds it until it has set up its waiter. Calling
    ``event.set()`` from the handler then waits for ever for a lock its own thread holds: the
    freeze of issue 16 (``py-spy dump`` of a SIGTERMed endpoint that never stopped: main thread in
    ``StopFlag._handler`` -> ``Event.set`` -> ``Condition.__enter__``, called from inside
    ``Event.wait`` in the telemetry loop). So the handler only counts the signal and writes one
    byte to a pipe; a relay thread sets ``event`` and calls ``on_signal``."""

    def __init__(self, on_signal: Callable[[], None] | None = None) -> None:
        self.event = threading.Event()
        self.signame = ""
        self._on_signal = on_signal
        self._previous: dict[int, _Handler] = {}
        self._received = 0  # signals so far (the handler's own count: no lock)
        self._wfd = -1
        self._relay: threading.Thread | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # On the main thread, between bytecodes: no lock, no I/O beyond two plain writes.
        if self._on_signal is None and self._received:
            os.write(2, b"kvpush: second signal: exiting without draining\n")
            os._exit(int(ExitStatus.INTERRUPTED))
        self._received += 1
        self.signame = self.signame or signal.Signals(signum).name
        with contextlib.suppress(OSError):  # a full pipe wakes the relay anyway
            os.write(self._wfd, b"s")

    def _relay_signals(self, rfd: int) -> None:
        """The relay thread: each byte is a signal; set the flag, call ``on_signal``."""
        try:
            while data := os.read(rfd, 64):
                for _ in data:
                    self.event.set()
                    if self._on_signal is not None:
                        try:
                            self._on_signal()
                        except Exception:  # a broken callback must not end the relay
                            log.exception("signal relay: on_signal failed")
        except OSError:
            return
        finally:
            os.close(rfd)

    def _start_relay(self) -> None:
        if self._relay is not None:
            return
        rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._relay = threading.Thread(
            target=self._relay_signals, args=(rfd,), name="signal-relay", daemon=True
        )
        self._relay.start()

    def install(self, signals: tuple[int, ...] = SIGNALS) -> StopFlag:
        self._start_relay()
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
        if self._wfd >= 0:  # the relay reads EOF and ends
            os.close(self._wfd)
            self._wfd = -1
            self._relay = None
