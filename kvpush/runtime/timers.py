"""``Timers``: many deadlines on one thread, and ``DueHeap``, the deadline heap behind it.

An endpoint that answers a request "when X happens, or at the latest in T seconds" (P's push
waits) must not start a thread per request: 3,000 waits were 3,009 threads. ``Timers`` keeps
every such deadline in one heap served by one thread, with a cap on how many it holds (``add``
returns None at the cap, so the caller refuses the request with a reason); a cancelled timer
costs nothing until its time comes, and the heap is compacted when cancelled entries pile up.
Callbacks run on the timer thread, one at a time, and must be short; one that raises is logged
and does not stop the others.

``DueHeap`` is the pure part (no threads): a min-heap of ``(due, seq, item)`` that hands back the
items whose time has come -- what a role's housekeeping uses to touch only what is due instead
of scanning a whole table every tick.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Stale entries a DueHeap keeps at most beyond twice its live items. An entry holds its item
#: until it goes (the request and push tables' heaps hold theirs weakly for that reason): at
#: 1,024 a busy D kept ~1,100 ended requests alive, ~20k objects, enough to set off a young
#: collection every ~1,200 requests (each walking them all with every thread stopped: 6-8 us
#: of D's CPU a push, pauses of 7-17 ms, ``bench rate``). Compaction stays amortised: about two
#: ``keep`` calls a push whatever the slack.
TRIM_SLACK = 128


class DueHeap(Generic[T]):
    """Items by due time (monotonic seconds); pure, owned by one thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()

    def push(self, due: float, item: T) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), item))

    def pop_due(self, now: float) -> Iterator[T]:
        """Remove and yield every item due at ``now`` (earliest first). The caller checks that
        an item still applies (its state may have moved on since it was pushed)."""
        h = self._heap
        while h and h[0][0] <= now:
            yield heapq.heappop(h)[2]

    def next_due(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def compact(self, keep: Callable[[T], bool]) -> None:
        """Drop the items ``keep`` rejects (stale entries of a table that moved on)."""
        self._heap = [e for e in self._heap if keep(e[2])]
        heapq.heapify(self._heap)

    def trim(self, live: int, keep: Callable[[T], bool], slack: int = TRIM_SLACK) -> None:
        """Compact once stale entries outnumber the ``live`` items (plus ``slack``): amortised,
        at most about two ``keep`` calls per push.

        An entry whose item moved on stays in the heap until it comes up, and holds its item.
        A table that answers thousands of requests a second under a 60 s deadline would keep
        hundreds of thousands of ended requests (with their futures) alive, and each full
        garbage collection walks them all: with 1M such objects a D stalled every thread for
        ~1 s (``bench rate``, one push in flight)."""
        if len(self._heap) > 2 * live + slack:
            self.compact(keep)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)


class Timer:
    """One scheduled callback; ``cancel`` is cheap and idempotent."""

    __slots__ = ("_owner", "cancelled", "fn")

    def __init__(self, owner: Timers, fn: Callable[[], None]) -> None:
        self._owner = owner
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._owner._cancelled()


class Timers:
    """Deadlines served by one daemon thread (started on the first ``add``), at most ``cap``
    pending at once."""

    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.cap = cap
        self._heap: DueHeap[Timer] = DueHeap()
        self._live = 0  # pending and not cancelled
        self._dead = 0  # cancelled, still in the heap
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def __len__(self) -> int:
        with self._cv:
            return self._live

    def add(self, delay_s: float, fn: Callable[[], None]) -> Timer | None:
        """Call ``fn`` on the timer thread in ``delay_s`` seconds; None at the cap or closed."""
        with self._cv:
            if self._closed or self._live >= self.cap:
                return None
            t = Timer(self, fn)
            self._heap.push(time.monotonic() + max(0.0, delay_s), t)
            self._live += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify()
            return t

    def _cancelled(self) -> None:
        with self._cv:
            self._live -= 1
            self._dead += 1
            if self._dead > 1024 and self._dead > self._live:
                self._heap.compact(lambda t: not t.cancelled)
                self._dead = 0

    def close(self) -> None:
        """Drop every pending timer (their callbacks never run) and stop the thread."""
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._live = self._dead = 0
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed:
                    now = time.monotonic()
                    due = [t for t in self._heap.pop_due(now)]
                    if due:
                        break
                    self._cv.wait(min(1.0, max(0.0, self._heap.next_due() - now)))
                if self._closed:
                    return
                fire = []
                for t in due:
                    if t.cancelled:
                        self._dead -= 1
                    else:
                        t.cancelled = True  # fired: a late cancel() is a no-op
                        self._live -= 1
                        fire.append(t)
            for t in fire:
                try:
                    t.fn()
                except Exception:  # one bad callback must not stop the others
                    log.exception("timer %s: a callback failed", self.name)
