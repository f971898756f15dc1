"""A few daemon threads that run one peer's short requests: drive's prefill legs.

Owns ``Senders``: ``submit(fn, *args)`` queues a call and returns its ``Future``; ``grow``
adds threads; ``close`` lets the threads end once the queue is drained. The threads are daemons
on purpose: a leg stuck at a frozen peer must not keep the process from exiting once every
request of a drive is accounted for (``concurrent.futures`` threads are joined at exit). The
leg itself records its outcome; a ``Future`` only says when it is done.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class Senders:
    """``n`` daemon threads named ``name-k`` draining one queue of calls."""

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Future[None], Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._name = name
        self._threads: list[threading.Thread] = []
        self.grow(n)

    def grow(self, n: int) -> None:
        """``n`` more threads (a call stuck at a dead peer holds one until its deadline)."""
        for _ in range(n):
            t = threading.Thread(
                target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def submit(self, fn: Callable[..., None], *args: object) -> Future[None]:
        fut: Future[None] = Future()
        self._q.put((fut, lambda: fn(*args)))
        return fut

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fut, call = job
            try:
                call()
                fut.set_result(None)
            except BaseException as e:  # the leg records its own failure; this is a backstop
                fut.set_exception(e)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
