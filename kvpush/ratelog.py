"""Rate-limited warnings: one line per kind per interval, with a count of what was suppressed.

Used by every thread that logs on behalf of peers (side channel, writer, receiver): a flood of
bad frames or failing pushes must not become a flood of log lines.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) >= self.interval_s:
            n = self._suppressed.pop(kind, 0)
            if n:
                self._log.warning(msg + " (%d similar suppressed)", *args, n)
            else:
                self._log.warning(msg, *args)
            self._last[kind] = now
        else:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
