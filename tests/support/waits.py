"""``wait_for``: poll a predicate until it holds, or fail the test with what it waited for."""

from __future__ import annotations

import time
from typing import Any


def wait_for(pred: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
