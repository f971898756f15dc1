"""What every view of a telemetry ``Snapshot`` reads from it: number formats and a few readings.

Owns the formats (milliseconds, bytes, rates, uptime, UTC timestamps) and the readings the
dashboard (``live``), the one-line forms (``lines``) and the reports share: which peer states
count as healthy, the latency a role reports as its p99, a gauge as an int, a rank's name.
Every name comes from ``kvpush.telemetry.names``, the same enums the endpoint bumps. Pure
functions and constants -- no threads, no clocks, no I/O; called on whichever thread renders
(the main thread of the command that owns the console).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable

from kvpush.config import Role
from kvpush.telemetry.names import Counter, Gauge, Hist, PeerState
from kvpush.telemetry.snapshot import HistSnapshot, Snapshot

#: Peer states counted as healthy ("peers=2/2") and drawn green; these drawn red; others (a
#: peer still connecting, or a state a newer endpoint reports) yellow.
OK_STATES = frozenset({PeerState.CONNECTED})
BAD_STATES = frozenset({PeerState.FAILED, PeerState.DOWN})

#: The latency that the plain line reports as ``p99`` for each role (else the first histogram).
PRIMARY_LATENCY = {Role.PREFILL: Hist.PUSH_LATENCY, Role.DECODE: Hist.DECODE_LATENCY}

#: The queue gauges of a plain line (and the ``Ranks`` table), by the key they print as.
PLAIN_QUEUE_KEYS = {
    Gauge.FINISHED_WAITING_REG: "finished",
    Gauge.REGS_WAITING_BLOCKS: "regs",
    Gauge.DEFERRED: "deferred",
    Gauge.INFLIGHT_WRITES: "inflight",
    Gauge.D_WAITING: "waiting",
}
#: The per-rank throughput by role: label, counter whose rate it shows.
RANK_THROUGHPUT = {
    Role.PREFILL: (("pushes/s", Counter.PUSHES_OK), ("GB/s", Counter.BYTES_PUSHED)),
    Role.DECODE: (("req/s", Counter.REQUESTS_OK), ("notifs/s", Counter.NOTIFS_RECEIVED)),
}
BYTE_COUNTERS = frozenset({Counter.BYTES_PUSHED, Counter.BYTES_RECEIVED})


# --- formatting helpers (pure) ----------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    """Milliseconds with about three significant digits: 0.047, 1.23, 41.0, 1230."""
    ms = seconds * 1e3
    if ms == 0:
        return "0"
    if ms < 1:
        return f"{ms:.3f}"
    if ms < 10:
        return f"{ms:.2f}"
    if ms < 100:
        return f"{ms:.1f}"
    return f"{ms:.0f}"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(per_s: float) -> str:
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.1f}"


def fmt_uptime(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def fmt_ts(ts: float) -> str:
    """UTC, to the second: the same line whatever the reader's time zone."""
    t = _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def peer_ok(row: dict[str, object]) -> bool:
    return str(row.get("state", "")) in OK_STATES


def primary_latency(snap: Snapshot) -> HistSnapshot | None:
    name = PRIMARY_LATENCY.get(snap.role, Hist.PUSH_LATENCY)
    if name in snap.histograms:
        return snap.histograms[name]
    return next(iter(snap.histograms.values()), None)


def int_gauge(snap: Snapshot, name: str) -> int:
    return int(snap.gauges.get(name, 0))


def rank_name(snap: Snapshot, index: int) -> str:
    """A rank snapshot's rank: its own ``info["rank"]``, else its place in ``ranks``."""
    return str(snap.info.get("rank", index))


def handshake_counts(peers: Iterable[dict[str, object]]) -> tuple[int, int, int]:
    """(connected, connecting, failed) peer rows; a state this version does not know counts
    as connecting (drawn yellow, as in the handshake table)."""
    ok = bad = other = 0
    for row in peers:
        state = str(row.get("state", ""))
        if state in OK_STATES:
            ok += 1
        elif state in BAD_STATES:
            bad += 1
        else:
            other += 1
    return ok, other, bad
