"""What the per-request phase stamps cost on each side (BENCHMARKS.md, issue 16): the code that
runs per request -- D's stamps and ``decode.completer.answered``, P's ``prefill.legs._phases``
equivalent -- timed with timeit (best of 15 x 20,000 calls).

    PYTHONPATH=. .venv/bin/python scripts/phase_stamp_cost.py
"""

from __future__ import annotations

import time
import timeit
from typing import Any

from kvpush.decode.completer import answered
from kvpush.telemetry import phases
from kvpush.telemetry.store import Telemetry
from kvpush.wire import protocol

tm = Telemetry("decode", "e", "i")
N = 20000


class _Req:  # the one field ``answered`` reads of a DRequest
    phases: dict[str, float] | None = None


def d_side(on: bool) -> dict[str, float]:
    r: Any = _Req()
    r.phases = {} if on else None
    for p in (
        phases.D_ALLOCATED,
        phases.PUSH_REG_SENT,
        phases.COMPLETION_RECEIVED,
        phases.VERIFIED,
    ):
        phases.stamp(r.phases, p)
    return answered(tm, r, True)


def p_side() -> dict[str, float]:
    now = time.monotonic()
    tm.observe("phase_match_wait", 0.001)
    shift = time.time() - now
    st = {
        phases.REGISTRATION_MATCHED: now - 0.004 + shift,
        phases.HANDSHAKE_DONE: now - 0.003 + shift,
        phases.WRITE_POSTED: now - 0.002 + shift,
        phases.WRITE_DONE: now - 0.001 + shift,
    }
    for h, s in phases.steps(st, phases.P_STEPS):
        tm.observe(h, s)
    return st


def best_us(fn: Any) -> float:
    return min(timeit.repeat(fn, number=N, repeat=15)) / N * 1e6


def main() -> None:
    st = d_side(True)
    with_ph = protocol.DecodeRep(transfer_id="t-1234-5", outcome="ok", phases=st)
    without = protocol.DecodeRep(transfer_id="t-1234-5", outcome="ok")
    print(f"D per request, stamps on:  {best_us(lambda: d_side(True)):.2f} us")
    print(f"D per request, stamps off: {best_us(lambda: d_side(False)):.2f} us")
    print(f"P per push, stamps on:     {best_us(p_side):.2f} us")
    print(
        f"DecodeRep encode: {best_us(lambda: protocol.encode(with_ph)):.2f} us with phases "
        f"({len(protocol.encode(with_ph))} B), {best_us(lambda: protocol.encode(without)):.2f} us "
        f"without ({len(protocol.encode(without))} B)"
    )


if __name__ == "__main__":
    main()
