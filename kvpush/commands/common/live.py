"""The rich renderings of a telemetry ``Snapshot``: the live dashboard and the summary table.

Owns the dashboard of one endpoint's telemetry (``kvpush serve-*`` on a terminal, the demo):
header, handshakes, queues, throughput, latency, failures and pool, each a small table built by
a pure function of one frozen snapshot -- no threads, no clocks, no I/O -- tested by rendering a
hand-built snapshot; and the summary table of a run's or a ``probe``'s endpoints. It reads the
snapshot through ``kvpush.commands.common.readings``, as the one-line forms (``lines``) do, so the
views cannot disagree. The ``Live`` loop that calls ``render_live`` once per refresh, and the
choice between the views (``isatty()``, ``--json``), belong to the command that owns the console
(on the main thread). The dashboard fits 100 columns.

Tensor parallelism: a snapshot with ``ranks`` (``kvpush.telemetry.merge``) is drawn as the
endpoint's totals, as for one rank, plus a ``Ranks`` table (each rank's queues, pool, handshakes
and throughput) and a ``rank`` column in the handshake table. A one-rank snapshot draws exactly
as it always did. A P's handshake table has a ``lane`` column (``lane_cell``: the WRITE's
transports, red with their flags) once its rows carry lanes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Unpack

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpush.commands.common.readings import (
    BAD_STATES,
    BYTE_COUNTERS,
    OK_STATES,
    PLAIN_QUEUE_KEYS,
    RANK_THROUGHPUT,
    fmt_bytes,
    fmt_ms,
    fmt_rate,
    fmt_ts,
    fmt_uptime,
    handshake_counts,
    int_gauge,
    peer_ok,
    primary_latency,
    rank_name,
)

if TYPE_CHECKING:
    from kvpush.commands.common.rows import TableKw
from kvpush.config import Role
from kvpush.telemetry.names import QUEUE_GAUGES, Counter, Gauge
from kvpush.telemetry.snapshot import Snapshot

__all__ = [
    "has_lanes",
    "lane_cell",
    "pool_bar",
    "ranks_table",
    "render_live",
    "render_summary_table",
]

WIDTH = 100

_POOL_STATES = (  # gauge, label, bar character, style
    (Gauge.POOL_ALLOCATED, "allocated", "█", "blue"),
    (Gauge.POOL_INFLIGHT, "inflight", "█", "magenta"),
    (Gauge.POOL_QUARANTINED, "quarantined", "█", "red"),
    (Gauge.POOL_FREE, "free", "░", "green"),
)
#: The ``info`` keys the header shows, by role (a D has no writer mode, a P no D->P handshake).
HEADER_INFO = {
    Role.PREFILL: ("address", "device", "writer", "backends", "version"),
    Role.DECODE: ("address", "device", "handshake", "backends", "version"),
}
#: Throughput rows by role: the rate's label and its counter (the ``now`` column is the rate,
#: ``total`` the count). A P completes no requests itself (its requests are its pushes) and a D
#: pushes nothing: each role shows only the rates it has.
THROUGHPUT = {
    Role.PREFILL: (
        ("pushes/s", Counter.PUSHES_OK),
        ("GB/s", Counter.BYTES_PUSHED),
        ("notifs/s", Counter.NOTIFS_RECEIVED),
    ),
    Role.DECODE: (
        ("requests/s", Counter.REQUESTS_OK),
        ("GB/s", Counter.BYTES_RECEIVED),
        ("notifs/s", Counter.NOTIFS_RECEIVED),
    ),
}
#: The queue columns of the ``Ranks`` table (``writes``: "inflight" names pool blocks there).
_RANK_QUEUE_COLUMNS = {**PLAIN_QUEUE_KEYS, Gauge.INFLIGHT_WRITES: "writes"}
_RANK_POOL_COLUMNS = (
    (Gauge.POOL_FREE, "free"),
    (Gauge.POOL_INFLIGHT, "inflight"),
    (Gauge.POOL_QUARANTINED, "quar."),
)
_BAR_WIDTH = 60
_MAX_PEER_ROWS = 12


def _state_style(state: str) -> str:
    if state in OK_STATES:
        return "green"
    if state in BAD_STATES:
        return "bold red"
    return "yellow"


def _cell(value: object, empty: str = "-") -> str:
    return empty if value is None or value == "" else str(value)


def _rank_rate(snap: Snapshot, name: str) -> str:
    if name not in snap.rates:
        return "-"
    rate = snap.rates[name]
    return f"{rate / 1e9:.2f}" if name in BYTE_COUNTERS else fmt_rate(rate)


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


def has_lanes(snap: Snapshot) -> bool:
    """Whether any peer row says which lane carries its KV (a P's rows, lanes on or off)."""
    return any(isinstance(r.get("lane"), dict) for r in snap.peers)


def lane_cell(row: Mapping[str, object]) -> Text:
    """A peer row's lane for a table cell: the WRITE's transports (``cma``, ``tcp``...), red
    with its flags (``tcp_on_one_host``, ``post_dominates``); ``ambiguous`` or ``?``."""
    lane = row.get("lane")
    if not isinstance(lane, dict):
        return Text("-", style="dim")
    write = lane.get("write")
    evidence = str(lane.get("evidence") or "")
    if isinstance(write, list) and write:
        text = Text("+".join(str(w) for w in write))
    elif evidence.startswith("ambiguous"):
        return Text("ambiguous", style="yellow")
    else:
        return Text("?", style="dim")
    flags = row.get("lane_flags")
    if isinstance(flags, list) and flags:
        text.stylize("bold red")
        text.append(" " + ",".join(str(f) for f in flags), style="red")
    return text


# --- the live view ----------------------------------------------------------------------------


def section(title: str | None = None, **kw: Unpack[TableKw]) -> Table:
    """A table as every view draws one: a bold cyan title on the left, a rule under the
    header, no edges."""
    return Table(
        title=title,
        title_justify="left",
        title_style="bold cyan",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        **kw,
    )


def _header(snap: Snapshot) -> Text:
    info = snap.info
    text = Text()
    text.append(f"kvpush {snap.role}", style="bold")
    text.append(f"  {snap.engine_id}")
    if snap.incarnation:
        text.append(f" ({snap.incarnation})", style="dim")
    for key in HEADER_INFO.get(snap.role, HEADER_INFO[Role.PREFILL]):
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
    ok = sum(1 for r in snap.peers if peer_ok(r))
    t = section(f"Handshakes  {ok}/{len(snap.peers)} ready", expand=True)
    ranked = bool(snap.ranks)  # merged rows name the rank that holds the peer
    if ranked:
        t.add_column("rank", justify="right", no_wrap=True)
    t.add_column("peer", no_wrap=True, max_width=24, overflow="ellipsis")
    t.add_column("engine id", no_wrap=True, max_width=14, overflow="ellipsis")
    t.add_column("mode", no_wrap=True)
    t.add_column("state", no_wrap=True)
    t.add_column("ms", justify="right", no_wrap=True)
    t.add_column("fails", justify="right", no_wrap=True)
    lanes = has_lanes(snap)
    if lanes:  # which transport carries the KV (P's rows), and its flags
        t.add_column("lane", no_wrap=True, max_width=24, overflow="ellipsis")
    t.add_column("last error", no_wrap=True, overflow="ellipsis", ratio=1)
    # Unhealthy peers first: they are what an operator looks for.
    rows = sorted(
        snap.peers, key=lambda r: (peer_ok(r), str(r.get("peer", "")), str(r.get("rank", "")))
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
            *([lane_cell(row)] if lanes else []),
            Text(_cell(row.get("last_error"), ""), style="red"),
        )
    if len(rows) > _MAX_PEER_ROWS:
        t.add_row(Text(f"… {len(rows) - _MAX_PEER_ROWS} more", style="dim"))
    if not rows:
        t.add_row(Text("no peers yet", style="dim"))
    return t


def _queues(snap: Snapshot) -> Table:
    t = section("Queues")
    t.add_column("queue")
    t.add_column("depth", justify="right")
    shown = [(name, label) for name, label in QUEUE_GAUGES.items() if name in snap.gauges]
    for name, label in shown:
        depth = int_gauge(snap, name)
        t.add_row(label, Text(f"{depth:,}", style="bold" if depth else "dim"))
    if not shown:
        t.add_row(Text("none reported", style="dim"), "")
    return t


def _throughput(snap: Snapshot) -> Table:
    r, c = snap.rates, snap.counters
    t = section("Throughput")
    t.add_column("")
    t.add_column("now", justify="right")
    t.add_column("total", justify="right")
    for label, name in THROUGHPUT.get(snap.role, THROUGHPUT[Role.PREFILL]):
        if name in (Counter.BYTES_PUSHED, Counter.BYTES_RECEIVED):
            now = f"{r[name] / 1e9:.2f}" if name in r else "-"
            t.add_row(label, now, fmt_bytes(c.get(name, 0)))
        else:
            now = fmt_rate(r[name]) if name in r else "-"
            t.add_row(label, now, f"{c.get(name, 0):,}")
    return t


def _latency(snap: Snapshot) -> Table:
    t = section("Latency (ms)")
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
    t = section("Failures")
    t.add_column("kind", no_wrap=True, max_width=24, overflow="ellipsis")
    t.add_column("count", justify="right")
    nonzero = sorted(((n, k) for k, n in snap.failures.items() if n), reverse=True)
    for n, kind in nonzero:
        t.add_row(kind, Text(f"{n:,}", style="bold red"))
    # The freeze watchdog (kvpush.runtime.watchdog): threads stalled now, stalls so far.
    stalled = int_gauge(snap, Gauge.THREADS_STALLED)
    stalls = snap.counters.get(Counter.WATCHDOG_STALLS, 0)
    if stalled:
        t.add_row("threads stalled now", Text(f"{stalled:,}", style="bold red"))
    if stalls:
        t.add_row(str(Counter.WATCHDOG_STALLS), Text(f"{stalls:,}", style="bold red"))
    if not nonzero and not stalls and not stalled:
        t.add_row(Text("none", style="green"), "")
    return t


def _pool(snap: Snapshot) -> RenderableType:
    total = int_gauge(snap, Gauge.POOL_TOTAL)
    t = section("Pool", show_header=False)
    t.add_column("")
    if not total:
        t.add_row(Text("no block pool reported", style="dim"))
        return t
    bar = pool_bar(Text(), snap, total, _BAR_WIDTH)
    legend = Text()
    for gauge, label, _, style in _POOL_STATES:
        if gauge in snap.gauges:
            legend.append(f"{label} ", style=style)
            legend.append(f"{int_gauge(snap, gauge):,}  ")
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


def pool_bar(bar: Text, snap: Snapshot, total: int, width: int) -> Text:
    """``bar`` with the pool's states appended in ``width`` cells (``total`` blocks)."""
    used = 0
    for i, (gauge, _, char, style) in enumerate(_POOL_STATES):
        n = int_gauge(snap, gauge)
        # A non-empty state shows at least one cell; free takes the remainder, so the bar
        # never overflows.
        want = max(round(width * n / total), 1 if n else 0)
        cells = width - used if i == len(_POOL_STATES) - 1 else min(width - used, want)
        bar.append(char * max(cells, 0), style=style)
        used += max(cells, 0)
    return bar


def ranks_table(
    t: Table,
    snap: Snapshot,
    queue_columns: Mapping[Gauge, str],
    pool_columns: Iterable[tuple[Gauge, str]],
    peers_label: str,
    *,
    styled_depths: bool,
) -> Table:
    """``t`` filled with one row per rank: queue depths, pool blocks, handshakes (ok/connecting/
    failed), throughput now; only the columns some rank reports. The full view styles the
    depths (bold when non-zero), the condensed view keeps them plain."""
    ranks = snap.ranks
    queues = [(g, k) for g, k in queue_columns.items() if any(g in r.gauges for r in ranks)]
    pool = [(g, k) for g, k in pool_columns if any(g in r.gauges for r in ranks)]
    rates = RANK_THROUGHPUT.get(snap.role, RANK_THROUGHPUT[Role.PREFILL])
    t.add_column("rank", justify="right", no_wrap=True)
    for _, label in (*queues, *pool):
        t.add_column(label, justify="right", no_wrap=True)
    t.add_column(peers_label, justify="right", no_wrap=True)
    for label, _ in rates:
        t.add_column(label, justify="right", no_wrap=True)
    for i, r in enumerate(ranks):
        depths = [int_gauge(r, g) for g, _ in queues]
        ok, connecting, failed = handshake_counts(r.peers)
        t.add_row(
            rank_name(r, i),
            *(
                Text(f"{n:,}", style="bold" if n else "dim") if styled_depths else f"{n:,}"
                for n in depths
            ),
            *(f"{int_gauge(r, g):,}" if g in r.gauges else "-" for g, _ in pool),
            Text(f"{ok}/{connecting}/{failed}", style="red" if failed else ""),
            *(_rank_rate(r, name) for _, name in rates),
        )
    return t


def _ranks(snap: Snapshot) -> Table:
    """One row per rank: queue depths, pool blocks, handshakes, throughput now."""
    # ok/conn/fail: the rank's handshake peers connected, connecting, failed.
    t = section("Ranks", collapse_padding=True)
    return ranks_table(
        t, snap, _RANK_QUEUE_COLUMNS, _RANK_POOL_COLUMNS, "ok/conn/fail", styled_depths=True
    )


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
        hist = primary_latency(snap)
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
