"""Renderers of a telemetry ``Snapshot``: the live dashboard, a plain log line and a JSON line.

Owns the three views of one endpoint's telemetry (``kvpush serve-*``, ``probe --stats``, the
demo). Every name comes from ``kvpush.telemetry.names`` (``Counter``, ``Gauge``, ``Hist``,
``PeerState``), the same enums the endpoint bumps. Pure functions of one frozen snapshot -- no
threads, no clocks, no I/O -- so the three outputs cannot disagree and each is tested by
rendering a hand-built snapshot. The ``Live`` loop that calls ``render_live`` once per refresh,
and the choice between the views (``isatty()``, ``--json``), belong to the command that owns
the console (on the main thread). The dashboard fits 100 columns.

Tensor parallelism: a snapshot with ``ranks`` (``kvpush.telemetry.merge``) is drawn as the
endpoint's totals, as for one rank, plus a ``Ranks`` table (each rank's queues, pool, handshakes
and throughput) and a ``rank`` column in the handshake table; its plain form is the totals line
followed by one ``rank=R/N`` line per rank. A one-rank snapshot draws exactly as it always did.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable

import msgspec
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpush.telemetry.names import QUEUE_GAUGES, Counter, Gauge, Hist, PeerState
from kvpush.telemetry.snapshot import HistSnapshot, Snapshot

__all__ = ["render_json", "render_live", "render_plain", "render_summary_table"]

WIDTH = 100

#: Peer states counted as healthy ("peers=2/2") and drawn green; these drawn red; others (a
#: peer still connecting, or a state a newer endpoint reports) yellow.
OK_STATES = frozenset({PeerState.CONNECTED})
BAD_STATES = frozenset({PeerState.FAILED})

#: The latency that the plain line reports as ``p99`` for each role (else the first histogram).
PRIMARY_LATENCY = {"prefill": Hist.PUSH_LATENCY, "decode": Hist.DECODE_LATENCY}

_PLAIN_QUEUE_KEYS = {
    Gauge.FINISHED_WAITING_REG: "finished",
    Gauge.REGS_WAITING_BLOCKS: "regs",
    Gauge.DEFERRED: "deferred",
    Gauge.INFLIGHT_WRITES: "inflight",
    Gauge.D_WAITING: "waiting",
}
_POOL_STATES = (  # gauge, label, bar character, style
    (Gauge.POOL_ALLOCATED, "allocated", "█", "blue"),
    (Gauge.POOL_INFLIGHT, "inflight", "█", "magenta"),
    (Gauge.POOL_QUARANTINED, "quarantined", "█", "red"),
    (Gauge.POOL_FREE, "free", "░", "green"),
)
#: The ``info`` keys the header shows, by role (a D has no writer mode, a P no D->P handshake).
HEADER_INFO = {
    "prefill": ("address", "device", "writer", "backends", "version"),
    "decode": ("address", "device", "handshake", "backends", "version"),
}
#: Throughput rows by role: label, counter (its rate when the snapshot carries one), scale.
THROUGHPUT = {
    "prefill": (
        ("pushes/s", Counter.PUSHES_OK),
        ("GB/s", Counter.BYTES_PUSHED),
        ("requests/s", Counter.REQUESTS_OK),
        ("notifs/s", Counter.NOTIFS_RECEIVED),
    ),
    "decode": (
        ("requests/s", Counter.REQUESTS_OK),
        ("GB received", Counter.BYTES_RECEIVED),
        ("notifs/s", Counter.NOTIFS_RECEIVED),
    ),
}
#: The per-rank throughput by role: label, counter whose rate it shows.
RANK_THROUGHPUT = {
    "prefill": (("pushes/s", Counter.PUSHES_OK), ("GB/s", Counter.BYTES_PUSHED)),
    "decode": (("req/s", Counter.REQUESTS_OK), ("notifs/s", Counter.NOTIFS_RECEIVED)),
}
#: The queue columns of the ``Ranks`` table (``writes``: "inflight" names pool blocks there).
_RANK_QUEUE_COLUMNS = {**_PLAIN_QUEUE_KEYS, Gauge.INFLIGHT_WRITES: "writes"}
_RANK_POOL_COLUMNS = (
    (Gauge.POOL_FREE, "free"),
    (Gauge.POOL_INFLIGHT, "inflight"),
    (Gauge.POOL_QUARANTINED, "quar."),
)
_BYTE_COUNTERS = frozenset({Counter.BYTES_PUSHED, Counter.BYTES_RECEIVED})
_BAR_WIDTH = 60
_MAX_PEER_ROWS = 12


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


def _state_style(state: str) -> str:
    if state in OK_STATES:
        return "green"
    if state in BAD_STATES:
        return "bold red"
    return "yellow"


def _peer_ok(row: dict[str, object]) -> bool:
    return str(row.get("state", "")) in OK_STATES


def _primary_latency(snap: Snapshot) -> HistSnapshot | None:
    name = PRIMARY_LATENCY.get(snap.role, Hist.PUSH_LATENCY)
    if name in snap.histograms:
        return snap.histograms[name]
    return next(iter(snap.histograms.values()), None)


def _int_gauge(snap: Snapshot, name: str) -> int:
    return int(snap.gauges.get(name, 0))


def _token(s: str) -> str:
    """A peer-supplied string as one whitespace-free word of the plain line."""
    return "_".join(s.split()) or "-"


def _cell(value: object, empty: str = "-") -> str:
    return empty if value is None or value == "" else str(value)


def _rank_name(snap: Snapshot, index: int) -> str:
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


def _rank_rate(snap: Snapshot, name: str) -> str:
    if name not in snap.rates:
        return "-"
    rate = snap.rates[name]
    return f"{rate / 1e9:.2f}" if name in _BYTE_COUNTERS else fmt_rate(rate)


def _devices(snap: Snapshot) -> str:
    """The ranks' devices: one, two joined, or the first and last of more."""
    seen: list[str] = []
    for r in snap.ranks:
        d = str(r.info.get("device", "?"))
        if d not in seen:
            seen.append(d)
    if len(seen) > 2:
        return f"{seen[0]}..{seen[-1]}"
    return ",".join(seen)


# --- the live view ----------------------------------------------------------------------------


def _section(title: str, **kw: object) -> Table:
    return Table(
        title=title,
        title_justify="left",
        title_style="bold cyan",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        **kw,  # type: ignore[arg-type]
    )


def _header(snap: Snapshot) -> Text:
    info = snap.info
    text = Text()
    text.append(f"kvpush {snap.role}", style="bold")
    text.append(f"  {snap.engine_id}")
    if snap.incarnation:
        text.append(f" ({snap.incarnation})", style="dim")
    for key in HEADER_INFO.get(snap.role, HEADER_INFO["prefill"]):
        if key in info:
            text.append(f"  {key} ", style="dim")
            text.append(_devices(snap) if key == "device" and snap.ranks else str(info[key]))
    if snap.ranks:
        text.append("  tp ", style="dim")
        text.append(str(len(snap.ranks)))
    text.append("  up ", style="dim")
    text.append(fmt_uptime(snap.uptime_s))
    text.append("  at ", style="dim")
    text.append(fmt_ts(snap.ts))
    return text


def _handshakes(snap: Snapshot) -> Table:
    ok = sum(1 for r in snap.peers if _peer_ok(r))
    t = _section(f"Handshakes  {ok}/{len(snap.peers)} ready", expand=True)
    ranked = bool(snap.ranks)  # merged rows name the rank that holds the peer
    if ranked:
        t.add_column("rank", justify="right", no_wrap=True)
    t.add_column("peer", no_wrap=True, max_width=24, overflow="ellipsis")
    t.add_column("engine id", no_wrap=True, max_width=14, overflow="ellipsis")
    t.add_column("mode", no_wrap=True)
    t.add_column("state", no_wrap=True)
    t.add_column("ms", justify="right", no_wrap=True)
    t.add_column("fails", justify="right", no_wrap=True)
    t.add_column("last error", no_wrap=True, overflow="ellipsis", ratio=1)
    # Unhealthy peers first: they are what an operator looks for.
    rows = sorted(
        snap.peers, key=lambda r: (_peer_ok(r), str(r.get("peer", "")), str(r.get("rank", "")))
    )
    for row in rows[:_MAX_PEER_ROWS]:
        state = str(row.get("state", ""))
        duration = row.get("duration_s")
        failures = row.get("failures") or 0
        t.add_row(
            *([_cell(row.get("rank"))] if ranked else []),
            _cell(row.get("peer")),
            _cell(row.get("engine_id")),
            _cell(row.get("mode")),
            Text(state or "-", style=_state_style(state)),
            fmt_ms(float(duration)) if isinstance(duration, int | float) else "-",
            Text(str(failures), style="red" if failures else ""),
            Text(_cell(row.get("last_error"), ""), style="red"),
        )
    if len(rows) > _MAX_PEER_ROWS:
        t.add_row(Text(f"… {len(rows) - _MAX_PEER_ROWS} more", style="dim"))
    if not rows:
        t.add_row(Text("no peers yet", style="dim"))
    return t


def _queues(snap: Snapshot) -> Table:
    t = _section("Queues")
    t.add_column("queue")
    t.add_column("depth", justify="right")
    shown = [(name, label) for name, label in QUEUE_GAUGES.items() if name in snap.gauges]
    for name, label in shown:
        depth = _int_gauge(snap, name)
        t.add_row(label, Text(f"{depth:,}", style="bold" if depth else "dim"))
    if not shown:
        t.add_row(Text("none reported", style="dim"), "")
    return t


def _throughput(snap: Snapshot) -> Table:
    r, c = snap.rates, snap.counters
    t = _section("Throughput")
    t.add_column("")
    t.add_column("now", justify="right")
    t.add_column("total", justify="right")
    for label, name in THROUGHPUT.get(snap.role, THROUGHPUT["prefill"]):
        if name in (Counter.BYTES_PUSHED, Counter.BYTES_RECEIVED):
            now = f"{r[name] / 1e9:.2f}" if name in r else "-"
            t.add_row(label, now, fmt_bytes(c.get(name, 0)))
        else:
            now = fmt_rate(r[name]) if name in r else "-"
            t.add_row(label, now, f"{c.get(name, 0):,}")
    return t


def _latency(snap: Snapshot) -> Table:
    t = _section("Latency (ms)")
    t.add_column("histogram", no_wrap=True, max_width=22, overflow="ellipsis")
    for col in ("count", "p50", "p90", "p99", "max"):
        t.add_column(col, justify="right", no_wrap=True)
    for name, h in snap.histograms.items():
        if h.count:
            t.add_row(
                name, f"{h.count:,}", fmt_ms(h.p50), fmt_ms(h.p90), fmt_ms(h.p99), fmt_ms(h.max)
            )
        else:
            t.add_row(name, "0", "-", "-", "-", "-", style="dim")
    if not snap.histograms:
        t.add_row(Text("nothing observed", style="dim"))
    return t


def _failures(snap: Snapshot) -> Table:
    t = _section("Failures")
    t.add_column("kind", no_wrap=True, max_width=24, overflow="ellipsis")
    t.add_column("count", justify="right")
    nonzero = sorted(((n, k) for k, n in snap.failures.items() if n), reverse=True)
    for n, kind in nonzero:
        t.add_row(kind, Text(f"{n:,}", style="bold red"))
    if not nonzero:
        t.add_row(Text("none", style="green"), "")
    return t


def _pool(snap: Snapshot) -> RenderableType:
    total = _int_gauge(snap, Gauge.POOL_TOTAL)
    t = _section("Pool", show_header=False)
    t.add_column("")
    if not total:
        t.add_row(Text("no block pool reported", style="dim"))
        return t
    bar = Text()
    used = 0
    for i, (gauge, _, char, style) in enumerate(_POOL_STATES):
        n = _int_gauge(snap, gauge)
        # A non-empty state shows at least one cell; free takes the remainder, so the bar
        # never overflows.
        want = max(round(_BAR_WIDTH * n / total), 1 if n else 0)
        cells = _BAR_WIDTH - used if i == len(_POOL_STATES) - 1 else min(_BAR_WIDTH - used, want)
        bar.append(char * max(cells, 0), style=style)
        used += max(cells, 0)
    legend = Text()
    for gauge, label, _, style in _POOL_STATES:
        if gauge in snap.gauges:
            legend.append(f"{label} ", style=style)
            legend.append(f"{_int_gauge(snap, gauge):,}  ")
    legend.append(f"of {total:,} blocks", style="dim")
    t.add_row(bar)
    t.add_row(legend)
    if Gauge.POOL_FREE_RUNS in snap.gauges:
        g = snap.gauges
        t.add_row(
            Text(
                f"free runs {int(g[Gauge.POOL_FREE_RUNS]):,}, largest "
                f"{int(g.get(Gauge.POOL_LARGEST_FREE_RUN, 0)):,} blocks; allocations "
                f"{g.get(Gauge.ALLOC_MEAN_RUN_LEN, 0.0):.1f} blocks per run",
                style="dim",
            )
        )
    return t


def _ranks(snap: Snapshot) -> Table:
    """One row per rank: queue depths, pool blocks, handshakes, throughput now."""
    ranks = snap.ranks
    # ok/conn/fail: the rank's handshake peers connected, connecting, failed.
    t = _section("Ranks", collapse_padding=True)
    queues = [(g, k) for g, k in _RANK_QUEUE_COLUMNS.items() if any(g in r.gauges for r in ranks)]
    pool = [(g, k) for g, k in _RANK_POOL_COLUMNS if any(g in r.gauges for r in ranks)]
    rates = RANK_THROUGHPUT.get(snap.role, RANK_THROUGHPUT["prefill"])
    t.add_column("rank", justify="right", no_wrap=True)
    for _, label in (*queues, *pool):
        t.add_column(label, justify="right", no_wrap=True)
    t.add_column("ok/conn/fail", justify="right", no_wrap=True)
    for label, _ in rates:
        t.add_column(label, justify="right", no_wrap=True)
    for i, r in enumerate(ranks):
        depths = [_int_gauge(r, g) for g, _ in queues]
        ok, connecting, failed = handshake_counts(r.peers)
        t.add_row(
            _rank_name(r, i),
            *(Text(f"{n:,}", style="bold" if n else "dim") for n in depths),
            *(f"{_int_gauge(r, g):,}" if g in r.gauges else "-" for g, _ in pool),
            Text(f"{ok}/{connecting}/{failed}", style="red" if failed else ""),
            *(_rank_rate(r, name) for _, name in rates),
        )
    return t


def _side_by_side(*parts: RenderableType) -> Table:
    grid = Table.grid(padding=(0, 4))
    for _ in parts:
        grid.add_column(vertical="top")
    grid.add_row(*parts)
    return grid


def render_live(snap: Snapshot) -> RenderableType:
    """The dashboard: header, handshakes, queues, throughput, latency, failures, pool; and with
    ranks, the per-rank table under these totals."""
    parts: list[RenderableType] = [
        _header(snap),
        Text(),
        _handshakes(snap),
        _side_by_side(_queues(snap), _throughput(snap)),
        _side_by_side(_latency(snap), _failures(snap)),
        _pool(snap),
    ]
    if snap.ranks:
        parts.append(_ranks(snap))
    return Group(*parts)


# --- one-line forms ---------------------------------------------------------------------------


def render_plain(snap: Snapshot) -> str:
    """One ``key=value`` line for logs and pipes (no colour, no trailing newline); with ranks,
    the totals line and then one ``rank_line`` per rank, ``\n``-separated."""
    lines = [_plain_totals(snap)]
    n = len(snap.ranks)
    lines += [rank_line(r, _rank_name(r, i), n) for i, r in enumerate(snap.ranks)]
    return "\n".join(lines)


def rank_line(snap: Snapshot, rank: str, tp: int) -> str:
    """One rank's short line: its throughput, queues, free blocks, peers and failures."""
    parts = [fmt_ts(snap.ts), _token(snap.role), _token(snap.engine_id), f"rank={rank}/{tp}"]
    for label, name in RANK_THROUGHPUT.get(snap.role, RANK_THROUGHPUT["prefill"]):
        rate = snap.rates.get(name, 0.0)
        value = f"{rate / 1e9:.2f}" if name in _BYTE_COUNTERS else f"{rate:.0f}"
        parts.append(f"{label}={value}")
    parts += [
        f"{key}={_int_gauge(snap, name)}"
        for name, key in _PLAIN_QUEUE_KEYS.items()
        if name in snap.gauges
    ]
    parts.append(f"fail={sum(snap.failures.values())}")
    return " ".join(parts + _pool_and_peers(snap))


def _pool_and_peers(snap: Snapshot) -> list[str]:
    """The last words of a plain line: free blocks of the pool, healthy peers."""
    parts = []
    if Gauge.POOL_TOTAL in snap.gauges:
        free, total = _int_gauge(snap, Gauge.POOL_FREE), _int_gauge(snap, Gauge.POOL_TOTAL)
        parts.append(f"pool_free={free}/{total}")
    ok = sum(1 for row in snap.peers if _peer_ok(row))
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
        f"{key}={_int_gauge(snap, name)}"
        for name, key in _PLAIN_QUEUE_KEYS.items()
        if name in snap.gauges
    ]
    hist = _primary_latency(snap)
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


def render_summary_table(snaps: Iterable[Snapshot]) -> Table:
    """One row per endpoint: totals and latency, e.g. at the end of a run or a ``probe``."""
    t = Table(title="Summary", title_justify="left", box=box.SIMPLE_HEAD)
    for col in (
        "role",
        "engine id",
        "pushes",
        "bytes",
        "requests",
        "failures",
        "p50 ms",
        "p99 ms",
        "up",
    ):
        t.add_column(col, justify="left" if col in ("role", "engine id") else "right", no_wrap=True)
    for snap in snaps:
        c = snap.counters
        hist = _primary_latency(snap)
        has = hist is not None and hist.count > 0
        t.add_row(
            snap.role,
            snap.engine_id,
            f"{c.get(Counter.PUSHES_OK, 0):,}",
            fmt_bytes(c.get(Counter.BYTES_PUSHED, 0)),
            f"{c.get(Counter.REQUESTS_OK, 0):,}",
            f"{sum(snap.failures.values()):,}",
            fmt_ms(hist.p50) if has and hist is not None else "-",
            fmt_ms(hist.p99) if has and hist is not None else "-",
            fmt_uptime(snap.uptime_s),
        )
    return t
