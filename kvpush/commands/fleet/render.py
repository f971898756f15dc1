"""The renderings of the fleet: ``fleet ls``'s table, ``fleet watch``'s live view and lines, and
``fleet check``'s matrix.

Pure functions of frozen data (``kvpush.commands.fleet.view.FleetRow`` / ``Change``,
``kvpush.commands.fleet.check.CheckReport``): no clocks, no threads, no I/O -- tested by rendering
hand-built rows. Records are data: every string that came from the registry or from a peer (an
address, a host, an engine id, a failure's detail) is drawn as ``Text`` (never parsed as Rich
markup) and through ``kvpush.logsafe.shown`` (control characters escaped: no terminal escape
reaches the screen, no newline forges a line); ``--json`` keeps them exact. The watch command's
short ``Live`` loop calls ``render_watch`` once per refresh; the choice between the live view
and lines (``isatty()``, ``--json``) belongs to the command.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypedDict

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpush.commands.common.live import section
from kvpush.commands.common.readings import fmt_rate, fmt_uptime
from kvpush.commands.fleet.fit import Column, chunks, fitted, width_of
from kvpush.commands.fleet.outcomes import OUTCOMES, CheckJSON, CheckReport, PairResult
from kvpush.commands.fleet.view import Change, FleetRow
from kvpush.config import Role
from kvpush.logsafe import shown

__all__ = [
    "check_json",
    "check_text",
    "event_line",
    "ls_table",
    "render_watch",
    "rows_json",
]

_HEALTH_STYLE = {"ok": "green", "stale": "yellow", "full": "yellow", "failing": "bold red"}
_OUTCOME_STYLE = {
    "ok": "green",
    "failed": "bold red",
    "incompatible": "yellow",
    "compatible": "cyan",
    "skipped": "dim",
    "left": "dim",
}
_EVENT_STYLE = {"join": "green", "leave": "red", "restart": "yellow"}
MAX_EVENT_LINES = 8


def short(incarnation: str) -> str:
    return incarnation[:8]


def data(text: object, style: str = "") -> Text:
    """A string from the registry or a peer as a cell: literal (no markup), one line."""
    return Text(shown(str(text)), style=style)


def _rate(rate: float | None) -> str:
    return "-" if rate is None else fmt_rate(rate)


_LS_COLUMNS = (
    Column("role"), Column("address"), Column("host", drop=6), Column("engine id", drop=9),
    Column("incarnation", drop=8), Column("tp", True, drop=4), Column("wire", drop=7),
    Column("age", True, drop=5), Column("free blocks", True, drop=1),
    Column("in flight", True, drop=3),
)  # fmt: skip
_RATE_COLUMN = Column("push/s", True, drop=2)
_HEALTH_COLUMN = Column("health")


def ls_table(
    rows: Sequence[FleetRow], cluster: str, *, rate: bool = False, width: int | None = None
) -> RenderableType:
    """The fleet as a table; ``rate`` adds the push rate column (the watch has two summaries).
    At most ``width`` wide (None: a pipe, nothing dropped): role, address and health stay,
    the other columns go first (``kvpush.commands.fleet.fit``)."""
    if not rows:
        what = (
            "no listed endpoint could be seen" if cluster == "listed" else "no endpoint registered"
        )
        return Text(f"cluster {cluster!r}: {what}", style="dim")
    n_p = sum(1 for r in rows if r.record.role == Role.PREFILL)
    cols = [*_LS_COLUMNS, *([_RATE_COLUMN] if rate else []), _HEALTH_COLUMN]
    cells: list[list[RenderableType]] = []
    for row in rows:
        r = row.record
        line: list[RenderableType] = [
            "P" if r.role == Role.PREFILL else "D",
            data(r.address),
            data(r.host),
            data(r.engine_id),
            data(short(r.incarnation)),
            str(r.tp_size),
            data(r.wire),
            fmt_uptime(row.age_s),
            f"{r.load.free_blocks}/{r.geometry.num_blocks}",
            str(r.load.in_flight),
        ]
        if rate:
            line.append(_rate(row.push_rate))
        line.append(Text(row.health, style=_HEALTH_STYLE.get(row.health, "")))
        cells.append(line)
    return fitted(f"cluster {cluster}: {n_p} prefill, {len(rows) - n_p} decode", cols, cells, width)


class RowsJSON(TypedDict):
    """``fleet ls --json`` (and the watch's ``snapshot``/``rows`` lines): the fleet's rows."""

    cluster: str
    endpoints: list[dict[str, object]]


def rows_json(rows: Iterable[FleetRow], cluster: str) -> RowsJSON:
    return {"cluster": cluster, "endpoints": [r.to_dict() for r in rows]}


# --- watch ------------------------------------------------------------------------------------


def event_line(ev: Change, t0: float) -> str:
    """One event as a plain line: ``+12.3s restart decode 10.0.0.7:5601 (host) ab12cd34 -> ...``
    (the record's strings escaped: one line, whatever they hold)."""
    text = f"+{ev.t - t0:.1f}s {ev.kind} {ev.role} {ev.address} ({ev.host}) "
    if ev.kind == "restart":
        text += f"incarnation {short(ev.previous)} -> {short(ev.incarnation)}"
    else:
        text += f"incarnation {short(ev.incarnation)}"
    return shown(text)


def render_watch(
    rows: Sequence[FleetRow],
    events: Sequence[Change],
    cluster: str,
    t0: float,
    status: str = "",
    width: int | None = None,
) -> RenderableType:
    """The live view: the table (with push rates), then the latest events, then a status line
    (registry trouble, the watch re-listing)."""
    parts: list[RenderableType] = [ls_table(rows, cluster, rate=True, width=width)]
    if events:
        tail = Text()
        for ev in list(events)[-MAX_EVENT_LINES:]:
            tail.append(event_line(ev, t0) + "\n", style=_EVENT_STYLE.get(ev.kind, ""))
        parts.append(Text("events", style="bold cyan"))
        parts.append(tail)
    if status:
        parts.append(data(status, style="yellow"))
    return Group(*parts)


# --- check ------------------------------------------------------------------------------------


def _cell(r: PairResult) -> Text:
    if r.outcome == "ok":
        lat = f"{r.p50_ms:.1f}ms" if r.p50_ms is not None else ""
        return Text(f"ok {lat}".strip(), style="green")
    if r.outcome == "incompatible":
        return Text("incompatible", style="yellow")
    if r.outcome == "compatible":
        return Text(_outcome(r), style="cyan")
    if r.outcome == "failed":
        return data(f"FAIL {r.reason}", style="bold red")
    if r.reason == "pool_too_small":
        return Text("pool too small", style="yellow")
    return Text(r.outcome, style="dim")


def _outcome(r: PairResult) -> str:
    """``compatible (metadata)``: what a pair checked by its metadata alone is called."""
    return f"compatible ({r.reason})" if r.outcome == "compatible" else r.outcome


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def check_text(rep: CheckReport, width: int | None = None) -> RenderableType:
    """The matrix (rows P, columns D, one word per pair), then one line per pair that is not ok
    (the reason, the fields that differ), then every pair's figures, then the counts."""
    parts: list[RenderableType] = []
    if not rep.pairs:
        parts.append(Text(f"cluster {rep.cluster!r}: no P x D pair to check", style="dim"))
        for n in rep.notes:
            parts.append(data(f"note: {n}"))
        return Group(*parts)
    parts += _matrix(rep, width)
    parts.append(_pairs_table(rep, width))
    counts = ", ".join(
        f"{rep.count(o)} {o}" for o in OUTCOMES if rep.count(o) or o in ("ok", "failed")
    )
    verdict = "FAILED" if int(rep.exit_status) else "passed"
    parts.append(
        Text(
            f"fleet check {verdict}: {len(rep.pairs)} pairs ({counts}) in {rep.elapsed_s:.1f}s "
            f"at concurrency {rep.concurrency}" + (" (strict)" if rep.strict else ""),
            style="bold red" if int(rep.exit_status) else "bold green",
        )
    )
    for n in rep.notes:
        parts.append(data(f"note: {n}"))
    return Group(*parts)


def _matrix(rep: CheckReport, width: int | None) -> list[RenderableType]:
    """The matrix (rows P, columns D, one word per pair) -- in groups of D columns that fit
    ``width`` --, its legend, and one line per pair that is not ok."""
    cells = {(p, d): _cell(rep.pair(p, d)) for p in rep.prefills for d in rep.decodes}
    first = max([width_of(data(p)) for p in rep.prefills] + [len("P \\ D")])
    widths = [
        max([len(f"D{i}")] + [width_of(cells[(p, d)]) for p in rep.prefills])
        for i, d in enumerate(rep.decodes)
    ]
    parts: list[RenderableType] = []
    for group in chunks(first, widths, width):
        title = f"cluster {rep.cluster}: {len(rep.prefills)} P x {len(rep.decodes)} D"
        if len(group) < len(rep.decodes):
            title += f" (D{group.start}-D{group.stop - 1})"
        m = section(title)
        m.add_column("P \\ D", no_wrap=True)
        for i in group:
            m.add_column(f"D{i}", no_wrap=True)
        for p in rep.prefills:
            m.add_row(data(p), *(cells[(p, rep.decodes[i])] for i in group))
        parts.append(m)
    legend = Text()
    for i, d in enumerate(rep.decodes):
        legend.append(f"D{i}={shown(d)}  ", style="dim")
    parts.append(legend)
    bad = [r for r in rep.pairs if r.outcome != "ok"]
    if bad:
        lines = Text()
        for r in bad:
            line = (
                f"{_outcome(r).upper()} {r.prefill} -> {r.decode}: "
                f"{r.reason}{': ' + r.detail if r.detail else ''}"
            )
            lines.append(shown(line) + "\n", style=_OUTCOME_STYLE.get(r.outcome, ""))
        parts.append(lines)
    return parts


_PAIR_COLUMNS = (
    Column("prefill"), Column("decode"), Column("outcome"), Column("blocks", True, drop=4),
    Column("pushes", True, drop=3), Column("first ms", True, drop=5),
    Column("handshake ms", True, drop=6), Column("p50 ms", True, drop=2),
    Column("GB/s", True, drop=1), Column("lane", drop=0),
)  # fmt: skip


def _pairs_table(rep: CheckReport, width: int | None) -> Table:
    """Every pair's figures (the addresses and the outcome whatever the width)."""
    rows: list[list[RenderableType]] = [
        [
            data(r.prefill),
            data(r.decode),
            Text(_outcome(r), style=_OUTCOME_STYLE.get(r.outcome, "")),
            str(r.blocks or "-"),
            f"{r.pushes_ok}/{r.pushes}" if r.pushes else "-",
            _ms(r.first_ms),
            _ms(r.handshake_ms),
            _ms(r.p50_ms),
            "-" if r.gb_per_s is None else f"{r.gb_per_s:.3f}",
            Text(r.lane or "-", style="bold red" if r.lane_flags else ""),
        ]
        for r in rep.pairs
    ]
    return fitted("pairs", _PAIR_COLUMNS, rows, width)


def check_json(rep: CheckReport) -> CheckJSON:
    return rep.to_dict()
