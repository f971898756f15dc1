"""Checks due at a time: the queue of ``drive --registry``'s checker threads.

Owns ``DueChecks``: registry records waiting for their check, earliest due first, run by ``n``
daemon threads (``drive-check-k``); one check of an address at a time -- a record wanted while
its address is being checked is checked right after, the latest one only. ``check(record)``
returns when to check that record again (None: not again); ``drop`` forgets an address (its key
went), ``stop`` ends the threads once their check in hand is done. Threads: ``want``, ``drop``
and ``stop`` from any thread (one condition); ``check`` runs on the checker threads.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from kvpush.fleet.record import EndpointRecord

log = logging.getLogger(__name__)

#: When a check raises (a bug), its record is checked again after this.
AFTER_A_BUG_S = 10.0


class DueChecks:
    """Records waiting for their check, earliest due first, checked by ``n`` daemon threads."""

    def __init__(self, n: int, check: Callable[[EndpointRecord], float | None]) -> None:
        self._check = check
        self._cond = threading.Condition()
        self._due: dict[str, tuple[float, EndpointRecord]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._running: dict[str, EndpointRecord | None] = {}  # -> the record wanted meanwhile
        self._dropped: set[str] = set()
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._run, name=f"drive-check-{k}", daemon=True)
            for k in range(n)
        ]
        for t in self._threads:
            t.start()

    def want(self, rec: EndpointRecord, delay_s: float = 0.0) -> None:
        addr = rec.address
        with self._cond:
            self._dropped.discard(addr)
            if addr in self._running:
                self._running[addr] = rec
                return
            due = time.monotonic() + delay_s
            old = self._due.get(addr)
            if old is not None and old[0] <= due:
                due = old[0]
            self._due[addr] = (due, rec)
            heapq.heappush(self._heap, (due, next(self._seq), addr))
            self._cond.notify()

    def drop(self, address: str) -> None:
        """No more checks of ``address`` (one running ends unrepeated)."""
        with self._cond:
            self._due.pop(address, None)
            if address in self._running:
                self._running[address] = None
                self._dropped.add(address)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _take(self) -> EndpointRecord | None:
        with self._cond:
            while not self._stopped:
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, addr = self._heap[0]
                entry = self._due.get(addr)
                if entry is None or entry[0] != due:
                    heapq.heappop(self._heap)  # dropped, or wanted sooner since
                    continue
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                del self._due[addr]
                self._running[addr] = None
                return entry[1]
        return None

    def _run(self) -> None:
        while True:
            rec = self._take()
            if rec is None:
                return
            try:
                again = self._check(rec)
            except Exception:  # a bug in one check must not end the checking
                log.exception("drive: the check of %s failed", rec.address)
                again = AFTER_A_BUG_S
            with self._cond:
                newer = self._running.pop(rec.address, None)
                dropped = rec.address in self._dropped
                self._dropped.discard(rec.address)
            if newer is not None:
                self.want(newer)
            elif again is not None and not dropped:
                self.want(rec, again)
