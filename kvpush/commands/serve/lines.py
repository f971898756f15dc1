"""The one-line forms of a telemetry ``Snapshot``: a plain ``key=value`` line and a JSON line.

Owns what ``kvpush serve-*`` prints when stdout is not a terminal (``--output plain``, the
default there, and ``--output json``): one line per interval, for logs, pipes and scripts. The
loop that prints them every ``--interval`` seconds belongs to the command (on the main thread);
these are pure functions of one frozen snapshot -- no threads, no clocks, no I/O, no rich --
reading it through ``kvpush.commands.common.readings`` as the dashboard does, so the two cannot
disagree. With ranks (``kvpush.telemetry.merge``), the plain form is the totals line followed
by one ``rank=R/N`` line per rank; the JSON line then holds every rank's own snapshot.
"""

from __future__ import annotations

import msgspec

from kvpush.commands.common.readings import (
    BYTE_COUNTERS,
    PLAIN_QUEUE_KEYS,
    RANK_THROUGHPUT,
    fmt_ms,
    fmt_ts,
    int_gauge,
    peer_ok,
    primary_latency,
    rank_name,
)
from kvpush.config import Role
from kvpush.telemetry.names import Counter, Gauge
from kvpush.telemetry.snapshot import Snapshot

__all__ = ["rank_line", "render_json", "render_plain"]


def _token(s: str) -> str:
    """A peer-supplied string as one whitespace-free word of the plain line."""
    return "_".join(s.split()) or "-"


def render_plain(snap: Snapshot) -> str:
    """One ``key=value`` line for logs and pipes (no colour, no trailing newline); with ranks,
    the totals line and then one ``rank_line`` per rank, ``\n``-separated."""
    lines = [_plain_totals(snap)]
    n = len(snap.ranks)
    lines += [rank_line(r, rank_name(r, i), n) for i, r in enumerate(snap.ranks)]
    return "\n".join(lines)


def rank_line(snap: Snapshot, rank: str, tp: int) -> str:
    """One rank's short line: its throughput, queues, free blocks, peers and failures."""
    parts = [fmt_ts(snap.ts), _token(snap.role), _token(snap.engine_id), f"rank={rank}/{tp}"]
    for label, name in RANK_THROUGHPUT.get(snap.role, RANK_THROUGHPUT[Role.PREFILL]):
        rate = snap.rates.get(name, 0.0)
        value = f"{rate / 1e9:.2f}" if name in BYTE_COUNTERS else f"{rate:.0f}"
        parts.append(f"{label}={value}")
    parts += [
        f"{key}={int_gauge(snap, name)}"
        for name, key in PLAIN_QUEUE_KEYS.items()
        if name in snap.gauges
    ]
    parts.append(f"fail={sum(snap.failures.values())}")
    return " ".join(parts + _pool_and_peers(snap))


def _pool_and_peers(snap: Snapshot) -> list[str]:
    """The last words of a plain line: free blocks of the pool, healthy peers."""
    parts = []
    if Gauge.POOL_TOTAL in snap.gauges:
        free, total = int_gauge(snap, Gauge.POOL_FREE), int_gauge(snap, Gauge.POOL_TOTAL)
        parts.append(f"pool_free={free}/{total}")
    ok = sum(1 for row in snap.peers if peer_ok(row))
    parts.append(f"peers={ok}/{len(snap.peers)}")
    return parts


def _plain_totals(snap: Snapshot) -> str:
    r = snap.rates
    parts = [
        fmt_ts(snap.ts),
        _token(snap.role),
        _token(snap.engine_id),
        f"pushes/s={r.get(Counter.PUSHES_OK, 0.0):.0f}",
        f"req/s={r.get(Counter.REQUESTS_OK, 0.0):.0f}",
        f"GB/s={r.get(Counter.BYTES_PUSHED, 0.0) / 1e9:.2f}",
    ]
    parts += [
        f"{key}={int_gauge(snap, name)}"
        for name, key in PLAIN_QUEUE_KEYS.items()
        if name in snap.gauges
    ]
    hist = primary_latency(snap)
    parts.append(f"p99={fmt_ms(hist.p99)}ms" if hist is not None and hist.count else "p99=-")
    failed = sum(snap.failures.values())
    top = sorted(((n, k) for k, n in snap.failures.items() if n), reverse=True)[:3]
    detail = f"[{','.join(f'{k}:{n}' for n, k in top)}]" if top else ""
    parts.append(f"fail={failed}{detail}")
    return " ".join(parts + _pool_and_peers(snap))


def render_json(snap: Snapshot) -> str:
    """One compact JSON object (``Snapshot.to_dict`` form); newlines only escaped inside.

    With ranks it holds ``ranks``: every rank's own snapshot, in the same form (its gauges --
    the queues and the pool --, counters, failures, rates, histograms and peer rows). One rank:
    no ``ranks`` key, the line it always was."""
    return msgspec.json.encode(snap).decode()
