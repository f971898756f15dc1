"""Drive's accounting: one result per request, each recorded once, none ever dropped.

Owns ``Ledger``: the intake (which request is next), what is in flight (when each request was
sent, to which P and D, by which worker) and the results. A request ends as ok, or failed with
one ``Failure`` reason and detail; the first of (decode reply, prefill failure, peer found dead,
interrupt, a schedule's refusal) decides it, later news of the same request is dropped
(``resolve`` returns False). ``fail_untaken`` ends every request not yet taken, ``fail_unresolved``
every one without a result; ``wait_all`` returns once each request has one and every ``on_resolved``
call has returned. ``on_resolved`` is called once per result, on the thread that decided it,
outside the lock.

Threads: any (drive's workers, P's executors, the monitor, the caller of ``Driver.run``); one
lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvpush.commands.common.results import RequestResult
from kvpush.telemetry.names import Failure


class Ledger:
    def __init__(
        self, requests: int, run_id: str, on_resolved: Callable[[RequestResult], None]
    ) -> None:
        self.requests = requests
        self._run_id = run_id
        self._on_resolved = on_resolved
        self._lock = threading.Lock()
        self._results: list[RequestResult | None] = [None] * requests
        self._sent: dict[int, tuple[float, str, str]] = {}  # index -> (t0, P, D)
        self._worker_of: dict[int, int] = {}  # request index -> the worker sending it
        self._done = 0
        self._handed = 0  # results whose on_resolved call has returned
        self._ok = 0
        self._all_done = threading.Event()
        self._next = 0

    def tid(self, i: int) -> str:
        """Request ``i``'s transfer id."""
        return f"{self._run_id}-{i}"

    # ------------------------------------------------------------------ intake
    def take(self) -> int | None:
        """The next request to send (None: every one was taken)."""
        with self._lock:
            if self._next >= self.requests:
                return None
            i = self._next
            self._next += 1
            return i

    def decided(self, i: int) -> bool:
        with self._lock:
            return self._results[i] is not None

    def mark_sent(self, i: int, p: str, d: str, wid: int) -> bool:
        """Request ``i`` goes out now, to ``p`` and ``d``, by worker ``wid`` (False: it was
        decided meanwhile -- no peer up, interrupted -- and must not be sent)."""
        with self._lock:
            if self._results[i] is not None:
                return False
            self._sent[i] = (time.monotonic(), p, d)
            self._worker_of[i] = wid
            return True

    def repick(self, i: int, p: str, d: str) -> bool:
        """Request ``i`` goes to P ``p`` after all (its send time kept); False when decided."""
        with self._lock:
            if self._results[i] is not None:
                return False
            t0 = self._sent.get(i, (time.monotonic(), p, d))[0]
            self._sent[i] = (t0, p, d)
            return True

    def sent_at(self, i: int) -> float | None:
        """When request ``i`` was sent (None: it is not in flight)."""
        with self._lock:
            got = self._sent.get(i)
        return got[0] if got is not None else None

    def worker_of(self, i: int) -> int | None:
        with self._lock:
            return self._worker_of.get(i)

    # ------------------------------------------------------------------ results
    def resolve(self, i: int, result: RequestResult) -> bool:
        """Record request ``i``'s result unless it already has one; True when recorded."""
        with self._lock:
            if self._results[i] is not None:
                return False
            self._results[i] = result
            self._sent.pop(i, None)
            self._worker_of.pop(i, None)
            self._done += 1
            self._ok += result.ok
        try:
            self._on_resolved(result)
        finally:
            # Only once every result has been handed on (its trace line, its span, fleet
            # check's pair): ``wait_all`` returning means every consumer has every result.
            with self._lock:
                self._handed += 1
                if self._handed == self.requests:
                    self._all_done.set()
        return True

    def fail(self, i: int, reason: Failure, detail: str, p: str = "", d: str = "") -> None:
        with self._lock:
            t0, p0, d0 = self._sent.get(i, (0.0, p, d))
        latency = time.monotonic() - t0 if t0 else 0.0
        self.resolve(
            i,
            RequestResult(
                i, self.tid(i), p0, d0, False, reason.value, detail[:500], latency, 0, None
            ),
        )

    def fail_untaken(self, reason: Failure, detail: str) -> None:
        """Every request not taken yet fails now (and none is taken after)."""
        with self._lock:
            first, self._next = self._next, self.requests
        for i in range(first, self.requests):
            self.fail(i, reason, detail)

    def fail_unresolved(self, reason: Failure, detail: str) -> None:
        with self._lock:
            pending = [i for i, r in enumerate(self._results) if r is None]
        for i in pending:
            self.fail(i, reason, detail)

    # ------------------------------------------------------------------ reading
    def wait_all(self, timeout_s: float) -> bool:
        """True once every request has its result (waits up to ``timeout_s``)."""
        return self._all_done.wait(timeout_s)

    def progress(self) -> tuple[int, int, int]:
        """(done, ok, failed) so far."""
        with self._lock:
            return self._done, self._ok, self._done - self._ok

    def in_flight(self) -> int:
        with self._lock:
            return len(self._sent)

    def results(self) -> list[RequestResult]:
        with self._lock:
            return [r for r in self._results if r is not None]
