"""``Heartbeat``: the progress a long-lived loop publishes for the freeze watchdog.

A loop thread calls ``start()`` as its loop begins, ``beat()`` on every iteration and ``park()``
when it ends; ``kvpush.runtime.watchdog.Watchdog`` reads the counter and the time of the last
beat from its own thread and reports a loop that stopped moving. Here, below the transport layer,
so that every loop (the side channel's included) can publish one.

Threads: written by the watched thread only (plain attribute stores, no lock: one writer), read
by the watchdog thread.
"""

from __future__ import annotations

import threading
import time


class Heartbeat:
    """Progress of one thread: ``beat()`` on every loop iteration (owner thread only)."""

    __slots__ = ("allowed_until", "count", "ident", "last", "name", "parked")

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.last = time.monotonic()
        self.ident: int | None = None
        self.parked = True  # not watched until the thread runs its loop
        self.allowed_until = 0.0

    def start(self) -> None:
        """On the watched thread, as its loop begins."""
        self.ident = threading.get_ident()
        self.beat()
        self.parked = False

    def beat(self) -> None:
        self.count += 1
        self.last = time.monotonic()

    def allow_until(self, deadline: float) -> None:
        """The thread may wait until ``deadline`` (monotonic) without it being a stall."""
        self.allowed_until = deadline
        self.beat()

    def park(self) -> None:
        """The thread has ended (or no longer loops): stop watching it."""
        self.parked = True
