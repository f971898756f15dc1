"""The live dashboard fitted to the terminal it is drawn on: the full view when it fits, else a
condensed one that keeps every section's numbers on screen.

``FittedView(snap)`` is a rich renderable that reads the size it is given at render time (a
terminal's size changes under a running view): when ``live.render_live`` fits that width and height
it draws exactly that; otherwise it draws ``render_compact``: a one-line header, the handshake rows
that fit (unhealthy first, then ``… N more``; a P's with their lane), the queues, rates, totals and
failures one line each, one line per observed histogram, the pool's bar and counts, and the
``Ranks`` table without rules. An 80x24 terminal holds every section of a P or D at TP <= 4 (the
handshake rows give way first). Pure: no threads, no clocks, no I/O; it renders on the thread of
the command that owns the console.
"""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from kvpush.commands.common.live import (
    THROUGHPUT,
    has_lanes,
    lane_cell,
    pool_bar,
    ranks_table,
    render_live,
)
from kvpush.commands.common.readings import (
    BYTE_COUNTERS,
    PLAIN_QUEUE_KEYS,
    fmt_bytes,
    fmt_ms,
    fmt_rate,
    fmt_uptime,
    int_gauge,
    peer_ok,
)
from kvpush.config import Role
from kvpush.telemetry.names import QUEUE_GAUGES, Gauge
from kvpush.telemetry.snapshot import Snapshot

__all__ = ["FittedView", "render_compact"]

#: The pool's legend (its bar is the full view's, ``live.pool_bar``).
_POOL = (
    (Gauge.POOL_ALLOCATED, "allocated"),
    (Gauge.POOL_INFLIGHT, "inflight"),
    (Gauge.POOL_QUARANTINED, "quar."),
    (Gauge.POOL_FREE, "free"),
)
#: Short names of the ``Ranks`` columns (the full view's words do not fit 80 columns at TP 2).
_RANK_QUEUES = {
    **PLAIN_QUEUE_KEYS,
    Gauge.FINISHED_WAITING_REG: "fin.",
    Gauge.DEFERRED: "defer",
    Gauge.INFLIGHT_WRITES: "writes",
}
_RANK_POOL = (
    (Gauge.POOL_FREE, "free"),
    (Gauge.POOL_INFLIGHT, "infl."),
    (Gauge.POOL_QUARANTINED, "quar."),
)


class FittedView:
    """``snap`` drawn to fit the width and height the console gives it at render time."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        height = options.height or console.height
        full = render_live(self.snap)
        lines = console.render_lines(full, options.update(height=None), pad=False)
        if len(lines) <= height and all(_cells(ln) <= width for ln in lines):
            yield full
        else:
            yield render_compact(self.snap, width, height)


def _cells(line: list[Segment]) -> int:
    return Segment.get_line_length(line)


def _words(title: str, pairs: list[tuple[str, str]], *, bad: bool = False) -> Text:
    """``Title  key value  key value`` on one line."""
    t = Text()
    t.append(f"{title:<9}", style="bold cyan")
    for i, (key, value) in enumerate(pairs):
        if i:
            t.append("  ")
        t.append(f"{key} ", style="dim")
        t.append(value, style="bold red" if bad else "")
    return t


def _header(snap: Snapshot) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"kvpush {snap.role}", style="bold")
    t.append(f"  {snap.engine_id}")
    for key in ("address", "device"):
        if key in snap.info:
            t.append(f"  {snap.info[key]}")
    if snap.ranks:
        t.append(f"  tp {len(snap.ranks)}")
    t.append(f"  up {fmt_uptime(snap.uptime_s)}")
    return t


def _queues(snap: Snapshot) -> Text:
    shown = [
        (PLAIN_QUEUE_KEYS[g], f"{int_gauge(snap, g):,}") for g in QUEUE_GAUGES if g in snap.gauges
    ]
    return _words("Queues", shown or [("none reported", "")])


def _rates(snap: Snapshot) -> tuple[Text, Text]:
    rates: list[tuple[str, str]] = []
    totals: list[tuple[str, str]] = []
    for label, name in THROUGHPUT.get(snap.role, THROUGHPUT[Role.PREFILL]):
        r = snap.rates.get(name)
        if name in BYTE_COUNTERS:
            rates.append((label, "-" if r is None else f"{r / 1e9:.2f}"))
            totals.append((name.removeprefix("bytes_"), fmt_bytes(snap.counters.get(name, 0))))
        else:
            rates.append((label, "-" if r is None else fmt_rate(r)))
            totals.append((label.removesuffix("/s"), f"{snap.counters.get(name, 0):,}"))
    return _words("Rates", rates), _words("Totals", totals)


def _latency(snap: Snapshot) -> list[Text]:
    out: list[Text] = []
    for name, h in snap.histograms.items():
        if h.count:
            out.append(
                _words(
                    "Latency" if not out else "",
                    [
                        (name, f"n={h.count:,}"),
                        ("p50", fmt_ms(h.p50)),
                        ("p99", fmt_ms(h.p99)),
                        ("max", f"{fmt_ms(h.max)} ms"),
                    ],
                )
            )
    return out or [_words("Latency", [("nothing observed", "")])]


def _failures(snap: Snapshot) -> Text:
    nonzero = sorted(((n, k) for k, n in snap.failures.items() if n), reverse=True)
    if not nonzero:
        return _words("Failures", [("none", "")])
    return _words("Failures", [(k, f"{n:,}") for n, k in nonzero], bad=True)


def _pool(snap: Snapshot, width: int) -> list[Text]:
    total = int_gauge(snap, Gauge.POOL_TOTAL)
    if not total:
        return [_words("Pool", [("no block pool reported", "")])]
    legend = [(label, f"{int_gauge(snap, g):,}") for g, label in _POOL if g in snap.gauges]
    legend.append(("of", f"{total:,} blocks"))
    bar = Text()
    bar.append(f"{'Pool':<9}", style="bold cyan")
    return [pool_bar(bar, snap, total, max(10, min(60, width - 10))), _words("", legend)]


def _ranks(snap: Snapshot) -> Table:
    t = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), title="Ranks",
              title_justify="left", title_style="bold cyan")  # fmt: skip
    return ranks_table(t, snap, _RANK_QUEUES, _RANK_POOL, "peers", styled_depths=False)


def _peers(snap: Snapshot, room: int) -> list[RenderableType]:
    """The handshake title line and at most ``room`` - 1 more lines of peer rows."""
    ok = sum(1 for r in snap.peers if peer_ok(r))
    title = Text(f"Handshakes  {ok}/{len(snap.peers)} ready", style="bold cyan")
    rows = sorted(
        snap.peers, key=lambda r: (peer_ok(r), str(r.get("peer", "")), str(r.get("rank", "")))
    )
    if not rows or room < 3:
        if rows and room >= 2:
            title.append(f"  (rows hidden: {len(rows)})", style="dim")
        return [title]
    t = Table(box=None, pad_edge=False, padding=(0, 1), show_header=True, expand=True)
    ranked = bool(snap.ranks)
    if ranked:
        t.add_column("rank", justify="right", no_wrap=True)
    t.add_column("peer", no_wrap=True, max_width=24, overflow="ellipsis")
    t.add_column("state", no_wrap=True)
    t.add_column("ms", justify="right", no_wrap=True)
    t.add_column("fails", justify="right", no_wrap=True)
    lanes = has_lanes(snap)
    if lanes:
        t.add_column("lane", no_wrap=True, max_width=20, overflow="ellipsis")
    t.add_column("last error", no_wrap=True, overflow="ellipsis", ratio=1)
    fit = room - 2  # the title and the column header
    shown = rows if len(rows) <= fit else rows[: max(fit - 1, 0)]
    for row in shown:
        state = str(row.get("state", ""))
        duration = row.get("duration_s")
        failures = row.get("failures") or 0
        t.add_row(
            *([str(row.get("rank", "-"))] if ranked else []),
            str(row.get("peer") or "-"),
            Text(state or "-", style="green" if peer_ok(row) else "yellow"),
            fmt_ms(float(duration)) if isinstance(duration, int | float) else "-",
            str(failures),
            *([lane_cell(row)] if lanes else []),
            Text(str(row.get("last_error") or ""), style="red"),
        )
    if len(shown) < len(rows):
        t.add_row(Text(f"… {len(rows) - len(shown)} more", style="dim"))
    return [title, t]


def render_compact(snap: Snapshot, width: int, height: int) -> RenderableType:
    """Every section of the dashboard in ``height`` lines of ``width`` columns (as far as the
    handshake rows can give way)."""
    rates, totals = _rates(snap)
    rest: list[RenderableType] = [
        _queues(snap),
        rates,
        totals,
        *_latency(snap),
        _failures(snap),
        *_pool(snap, width),
    ]
    if snap.ranks:
        rest.append(_ranks(snap))
    used = 1 + len(rest) - (1 if snap.ranks else 0) + (2 + len(snap.ranks) if snap.ranks else 0)
    return Group(_header(snap), *_peers(snap, height - used), *rest)
