"""``Relay``: moves IP packets between two TUN fds (``tests.support.netns.NetnsPair``) after a
delay, or drops everything while ``partitioned`` (a slow, then cut, link). Runs on a daemon
thread of its own (``start``/``stop``); the test thread flips ``partitioned`` and reads the
counts.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import threading
import time


class Relay:
    """Move IP packets between two TUN fds after ``delay_s``; ``partition`` drops everything."""

    def __init__(self, fd_a: int, fd_b: int, delay_s: float) -> None:
        self.fds = (fd_a, fd_b)
        self.delay_s = delay_s
        self.partitioned = False
        self.forwarded = 0
        self.forwarded_bytes = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="tun-relay", daemon=True)

    def start(self) -> Relay:
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)

    def _run(self) -> None:
        import select

        a, b = self.fds
        other = {a: b, b: a}
        queue: list[tuple[float, int, int, bytes]] = []
        seq = 0
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = 0.05
            if queue:
                timeout = max(0.0, min(timeout, queue[0][0] - now))
            r, _, _ = select.select([a, b], [], [], timeout)
            now = time.monotonic()
            for fd in r:
                for _ in range(64):
                    try:
                        pkt = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    if self.partitioned:
                        self.dropped += 1
                    else:
                        seq += 1
                        heapq.heappush(queue, (now + self.delay_s, seq, other[fd], pkt))
                    if not _readable(fd):
                        break
            while queue and queue[0][0] <= time.monotonic():
                _, _, dst, pkt = heapq.heappop(queue)
                with contextlib.suppress(OSError):
                    os.write(dst, pkt)
                    self.forwarded += 1
                    self.forwarded_bytes += len(pkt)


def _readable(fd: int) -> bool:
    import select

    r, _, _ = select.select([fd], [], [], 0)
    return bool(r)
