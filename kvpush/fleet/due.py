"""Keyed work that falls due, runs on a small pool, and is due again after a delay.

Owns ``DueRunner``: the scheduler ``kvpush.fleet.prewarm`` (a warm-up tried again with back-off
until a pair is warm) and ``kvpush.fleet.suspects`` (a registry hint looked at again while
nothing is proven) share. An item is any object with a ``due`` time (``time.monotonic()``) and a
``running`` flag; its owner keeps it in ``items`` under ``lock`` (adding, replacing, dropping as
its own rules say). Every ``tick_s`` the runner's thread hands each item that is due and not
running -- earliest due first, at most ``limit`` running at once (None: no limit beyond the
pool's queue) -- to ``work`` on one of ``workers`` pool threads. ``work`` returns the seconds
after which the item is due again, or None when it is finished: it is taken out of ``items``,
unless it was replaced meanwhile (``drop`` takes it out earlier, from inside ``work``). ``work``
catches and says its own errors; one that raises anyway finishes its item.

Threads: the runner's own (``name``), ``workers`` pool threads (``name`` as their prefix), and
the owner's, which touch ``items`` under ``lock`` only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar


class Due(Protocol):
    """What the runner reads and sets of an item."""

    due: float
    running: bool


K = TypeVar("K", bound=Hashable)
T = TypeVar("T", bound=Due)


class DueRunner(Generic[K, T]):
    def __init__(
        self,
        work: Callable[[T], float | None],
        *,
        name: str,
        pool_name: str,
        workers: int,
        tick_s: float,
        limit: int | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.items: dict[K, T] = {}  # under ``lock``
        self._work = work
        self._tick = tick_s
        self._limit = limit
        self._running = 0  # items handed to the pool and not settled yet (under ``lock``)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=pool_name)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stopping(self) -> bool:
        return self._stop.is_set()

    def count(self) -> int:
        with self.lock:
            return len(self.items)

    def drop(self, key: K, item: T) -> None:
        """Take ``item`` out now (from inside ``work``), unless it was replaced under ``key``."""
        with self.lock:
            if self.items.get(key) is item:
                del self.items[key]

    # ------------------------------------------------------------------ the runner's thread
    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self.lock:
                due = [(k, t) for k, t in self.items.items() if not t.running and t.due <= now]
                due.sort(key=lambda kt: kt[1].due)
                if self._limit is not None:
                    due = due[: max(0, self._limit - self._running)]
                for _, t in due:
                    t.running = True
                self._running += len(due)
            for k, t in due:
                try:
                    self._pool.submit(self._one, k, t)
                except RuntimeError:  # the pool is shut down: stopping
                    return

    # ------------------------------------------------------------------ pool threads
    def _one(self, key: K, item: T) -> None:
        again: float | None = None
        try:
            again = self._work(item)
        finally:
            with self.lock:
                self._running -= 1
                item.running = False
                if again is not None:
                    item.due = time.monotonic() + again
                elif self.items.get(key) is item:
                    del self.items[key]
