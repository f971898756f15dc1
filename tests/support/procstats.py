"""A process's RSS, open fds and threads from ``/proc``: memory and handles stay bounded.

``ProcStats.of(pid)`` reads them; ``before.assert_bounded(after, what)`` fails when one grew by
more than its bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcStats:
    rss_mb: float
    fds: int
    threads: int

    @staticmethod
    def of(pid: int) -> ProcStats:
        rss = threads = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
        return ProcStats(rss / 1024, len(os.listdir(f"/proc/{pid}/fd")), threads)

    def assert_bounded(
        self, after: ProcStats, what: str, rss_mb: float = 96, fds: int = 24, threads: int = 16
    ) -> None:
        assert after.rss_mb - self.rss_mb < rss_mb, f"{what}: RSS grew {self} -> {after}"
        assert after.fds - self.fds < fds, f"{what}: open fds grew {self} -> {after}"
        assert after.threads - self.threads < threads, f"{what}: threads grew {self} -> {after}"
