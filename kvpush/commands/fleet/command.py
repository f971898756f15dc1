"""``kvpush fleet ls|watch|check``: the endpoints registered in etcd or listed, seen and checked.

Options -> ``kvpush.commands.fleet.source.FleetSource`` (the registry, the ``--endpoints``
files and ``--peer`` values, any of them) -> one call into this folder
(``view`` for ls, ``watch`` for watch, ``check`` for check) -> the renderings
of ``kvpush.commands.fleet.render``: a table or one JSON object, the live view on a terminal (a
short ``Live`` loop) or one line per event when stdout is not one, and the check's matrix. etcd not
answering is ``RegistryUnavailable``: one ``error:`` and ``hint:``, exit 69. What a record holds
is data, never markup or terminal control: the views escape it; this module's own lines (the
watch's registry status) go through ``kvpush.logsafe.shown``. Runs on the main thread (the
watch's reader thread and the check's pair threads belong to ``check`` and ``watch``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, RenderableType

from kvpush.commands.common import options, stdio, translate
from kvpush.commands.common.optspec import PANEL_OUT, option
from kvpush.config import Role, require_positive
from kvpush.errors import ConfigError, ExitStatus
from kvpush.logsafe import shown
from kvpush.runtime.signals import StopFlag

if TYPE_CHECKING:
    from kvpush.commands.fleet.source import FleetSource
    from kvpush.commands.fleet.watch import FleetWatch

#: The width of the console that writes to a pipe: wide enough that nothing is ever cut
#: (the tables drop no column there, and lines are only as wide as what they hold).
PIPE_WIDTH = 100_000

HELP = (
    "See and check a fleet: the endpoints registered in etcd (serve-* --registry URL), or "
    "listed with --endpoints FILE / --peer HOST:PORT (kvpush endpoints and vLLM engines)."
)

_FLEET_DOC = """

The fleet is the endpoints registered under --cluster in --registry, and/or the ones listed
with --endpoints FILE|- (one per line: 'HOST:PORT [prefill|decode] [tp=N]', '#' comments, or
JSON lines {"address": ..., "role": ..., "tp": ...}) and --peer HOST:PORT[=ROLE]. A listed
entry is a kvpush endpoint or a vLLM engine's side channel (it is sent only vLLM's
get_meta_msg); a vLLM engine's role and TP size come from the listing, since its metadata
carries neither. Listed endpoints are contacted --concurrency at a time; a bad line, a
duplicate, or an entry that cannot be seen is one 'warning:' line on stderr and the rest goes
on."""

LS_DOC = """List every endpoint registered in the cluster.

One row per endpoint: role, side-channel address, host, engine id, incarnation (short), TP size,
wire, age, free blocks of its pool, requests in flight and health as its record shows it (ok;
stale: no load summary for 25 s; full: a D with no free block). --json prints the records
whole (and the listing's problems). Exit status 0 (an empty cluster says so), 69 when etcd does
not answer."""

WATCH_DOC = """Follow the cluster live: every endpoint; joins, leaves and restarts as they happen.

On a terminal: a table of every endpoint (role, host, age, incarnation, health, free blocks, in
flight, pushes per second from successive load summaries) redrawn every --interval, with the
latest events below it. Otherwise one line per event ('join', 'leave', 'restart' -- the same
address with a new incarnation --, the registry going down or coming back); with --json one JSON
object per line: a 'snapshot' first, then the events, and a 'rows' line every --interval. Rides
out etcd going away (it lists again when etcd is back and reports what changed meanwhile). Stops
after --duration seconds, or at Ctrl-C (exit 0)."""

CHECK_DOC = """Push through every P x D pair of the cluster and report the matrix.

For each pair: compatibility from the two records (the differing fields named: such a pair is
'incompatible' and is not driven), then --pushes verified pushes of --size bytes through the
endpoints themselves, as drive sends them (the first one carries the handshake of a pair that
never met): handshake time (first push minus the median of the rest), push latency p50, GB/s,
and the outcome. Pairs run --concurrency at a time, each within --deadline seconds, and pairs
that share an endpoint only as many at once as its pool holds (the check never fills a pool
itself). A pair whose pushes fail is named with the reason (e.g. no_free_blocks: the D's pool
is full; decode_unreachable: P cannot reach D; deadline: a peer froze) -- 'left' only when one
of its endpoints is proven gone (its port refuses connections, or a new incarnation answers
there), not because its key left the registry. Exit status 0 when every pair that can work
works, 3 when one does not (with --strict also when a pair is incompatible or skipped), 69 when
etcd does not answer; also 3 when a listed endpoint could not be seen."""


def register(app: typer.Typer) -> None:
    subs = [
        options.Sub("ls", ls, LS_DOC + _FLEET_DOC, options.REGISTRY),
        options.Sub("watch", watch, WATCH_DOC + _FLEET_DOC, options.REGISTRY),
        options.Sub("check", check, CHECK_DOC + _FLEET_DOC, options.REGISTRY),
    ]
    options.add_group(app, "fleet", HELP, subs)


def _out() -> tuple[Console, int | None]:
    """stdout's console and the width its tables must fit: a terminal's width, or None for a
    pipe (every column, nothing cut: grep and awk get whole lines)."""
    if sys.stdout.isatty():
        c = Console(highlight=False)
        return c, c.width
    return Console(highlight=False, width=PIPE_WIDTH), None


def _print(make: Callable[[int | None], RenderableType]) -> None:
    """``make(width)`` printed on stdout at the width it must fit."""
    console, width = _out()
    console.print(make(width), soft_wrap=True)


Endpoints = Annotated[
    list[str] | None,
    option(
        "--endpoints",
        help="A file listing endpoints ('-': stdin), one per line: HOST:PORT [prefill|decode] "
        "[tp=N]; repeatable. With or instead of --registry.",
        metavar="FILE|-",
        show_default=False,
        env=False,
    ),
]
Peers = Annotated[
    list[str] | None,
    option(
        "--peer",
        help="One endpoint, HOST:PORT[=ROLE] (ROLE: prefill or decode; a vLLM engine needs "
        "it); repeatable.",
        metavar="HOST:PORT[=ROLE]",
        show_default=False,
        env=False,
    ),
]
ListConcurrency = Annotated[
    int,
    option("--concurrency", "-c", help="Listed endpoints contacted at once.", env=False),
]


def fleet_source(
    p: dict[str, object],
    endpoints: list[str] | None,
    peers: list[str] | None,
    concurrency: int,
    token_file: str | None = None,
) -> FleetSource:
    from kvpush.commands.fleet.source import fleet_source

    require_positive("--concurrency", concurrency)
    token = translate.auth_token(token_file)
    return fleet_source(p, endpoints or [], peers or [], concurrency, token)


def _warn(problems: list[str]) -> None:
    """The listing's problems, one ``warning:`` line each on stderr."""
    for line in problems:
        stdio.err(shown(f"warning: {line}"))


# --------------------------------------------------------------------------- ls


def ls(
    json_out: Annotated[
        bool,
        option("--json", help="One JSON object on stdout.", scope="fleet_ls", panel=PANEL_OUT),
    ] = False,
    endpoints: Endpoints = None,
    peer: Peers = None,
    concurrency: ListConcurrency = 16,
    auth_token_file: options.AuthTokenFile = None,
    **p: object,  # options.REGISTRY
) -> None:
    from kvpush.commands.fleet import render as views
    from kvpush.commands.fleet.view import rows_of

    src = fleet_source(p, endpoints, peer, concurrency, auth_token_file)
    listed = src.list()
    rows = rows_of(listed.records, time.time())
    if json_out:
        stdio.out(json.dumps({**views.rows_json(rows, src.cluster), "problems": listed.problems}))
    else:
        _warn(listed.problems)
        _print(lambda w: views.ls_table(rows, src.cluster, width=w))
    raise typer.Exit(0)


# --------------------------------------------------------------------------- watch


def watch(
    json_out: Annotated[
        bool,
        option(
            "--json",
            help="One JSON object per line on stdout: the listing at start ('snapshot'), then "
            "each join, leave and restart, and a 'rows' line every --interval.",
            scope="fleet_watch",
            panel=PANEL_OUT,
        ),
    ] = False,
    duration: Annotated[
        float | None,
        option(
            "--duration",
            help="Stop after this many seconds (default: until Ctrl-C).",
            seconds=True,
            show_default=False,
        ),
    ] = None,
    interval: Annotated[
        float,
        option(
            "--interval",
            help="Seconds between redraws of the live view (and between 'rows' lines).",
            scope="fleet",
            seconds=True,
        ),
    ] = 1.0,
    endpoints: Endpoints = None,
    peer: Peers = None,
    concurrency: ListConcurrency = 16,
    auth_token_file: options.AuthTokenFile = None,
    **p: object,  # options.REGISTRY
) -> None:
    from kvpush.commands.fleet.watch import FleetWatch

    require_positive("--interval", interval)
    if duration is not None:
        require_positive("--duration", duration)
    w = FleetWatch(fleet_source(p, endpoints, peer, concurrency, auth_token_file))
    w.start()
    if not json_out:
        _warn(w.problems)
    stop = StopFlag().install()
    try:
        if sys.stdout.isatty() and not json_out:
            _watch_live(w, interval, duration, stop)
        else:
            _watch_lines(w, interval, duration, stop, json_out)
    finally:
        stop.restore()
        w.stop()
    raise typer.Exit(0)


def _until(duration: float | None) -> float:
    return time.monotonic() + duration if duration is not None else float("inf")


def _watch_live(w: FleetWatch, interval: float, duration: float | None, stop: StopFlag) -> None:
    from rich.live import Live

    from kvpush.commands.fleet import render as views
    from kvpush.commands.fleet.watch import Note, Status

    console = Console()
    end = _until(duration)
    status = ""

    def frame() -> RenderableType:
        return views.render_watch(  # console.width follows a resized terminal
            w.rows(), list(w.model.events), w.source.cluster, w.started_at, status, console.width
        )

    with Live(frame(), console=console, refresh_per_second=4, transient=False) as live:
        next_draw = time.monotonic() + interval
        while not stop.event.is_set() and time.monotonic() < end:
            wait = max(0.0, min(next_draw, end) - time.monotonic())
            for item in w.poll(min(wait, 0.25)):
                if isinstance(item, Status):
                    status = "" if item.up else f"registry down: {item.detail}"
                elif isinstance(item, Note):
                    status = item.detail
            if time.monotonic() >= next_draw:
                next_draw = time.monotonic() + interval
            live.update(frame())


def _watch_lines(
    w: FleetWatch, interval: float, duration: float | None, stop: StopFlag, json_out: bool
) -> None:
    from kvpush.commands.fleet import render as views
    from kvpush.commands.fleet.watch import Note, Status

    cluster = w.source.cluster
    t0 = w.started_at
    rows = w.rows()
    if json_out:
        snap = {"event": "snapshot", "t": round(time.time(), 3), **views.rows_json(rows, cluster)}
        snap["listed_in_s"] = round(w.listed_in_s, 4)
        snap["problems"] = w.problems
        stdio.out(json.dumps(snap))
    else:
        _print(lambda w: views.ls_table(rows, cluster, width=w))
    end = _until(duration)
    next_rows = time.monotonic() + interval
    while not stop.event.is_set() and time.monotonic() < end:
        wait = max(0.0, min(next_rows, end) - time.monotonic())
        for item in w.poll(min(wait, 0.25)):
            if json_out:
                stdio.out(json.dumps(item.to_dict()))
            elif isinstance(item, Status):
                stdio.out(
                    shown(
                        f"+{item.t - t0:.1f}s registry "
                        + ("up again: listed anew" if item.up else f"down: {item.detail}")
                    )
                )
            elif isinstance(item, Note):
                stdio.out(shown(f"+{item.t - t0:.1f}s {item.detail}"))
            else:
                stdio.out(views.event_line(item, t0))
        if json_out and time.monotonic() >= next_rows:
            next_rows = time.monotonic() + interval
            line = {
                "event": "rows",
                "t": round(time.time(), 3),
                **views.rows_json(w.rows(), cluster),
            }
            stdio.out(json.dumps(line))


# --------------------------------------------------------------------------- check

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?)[bB]?\s*$")
_UNIT = {"": 0, "k": 1, "m": 2, "g": 3}


def parse_size(text: str) -> int:
    """``1MiB`` -> 1048576, ``256k`` -> 262144 (binary units), ``4096`` -> 4096."""
    m = _SIZE.match(text)
    if m is None:
        raise ConfigError(
            f"invalid value for --size: {text!r}", "give bytes, e.g. 4096, 256KiB, 1MiB or 1GiB"
        )
    return max(1, int(float(m.group(1)) * 1024 ** _UNIT[m.group(2).lower()]))


def check(
    size: Annotated[
        str,
        option(
            "--size",
            help="Bytes per check push (e.g. 1MiB, 256KiB, 4096): blocks = size / one block "
            "of P (capped at the smaller pool).",
        ),
    ] = "1MiB",
    pushes: Annotated[
        int,
        option(
            "--pushes",
            help="Verified pushes per pair (the first carries the handshake of a pair that "
            "never met).",
        ),
    ] = 3,
    concurrency: Annotated[
        int, option("--concurrency", "-c", help="Pairs checked at once.", scope="fleet")
    ] = 8,
    deadline: Annotated[
        float,
        option(
            "--deadline",
            help="Seconds one pair's check may take (every push included); a pair past it "
            "fails with 'deadline'.",
            seconds=True,
        ),
    ] = 10.0,
    strict: Annotated[
        bool,
        option(
            "--strict",
            help="Also fail (exit 3) on incompatible or skipped pairs, not only on pairs whose "
            "pushes fail.",
        ),
    ] = False,
    warm: Annotated[
        bool,
        option(
            "--warm",
            help="Leave every pair that passed handshaken both ways: ask each endpoint for its "
            "peer table, push once more through a pair found cold, and exit 3 if one stays cold.",
        ),
    ] = False,
    json_out: Annotated[
        bool,
        option(
            "--json",
            help="The whole matrix as one JSON object on stdout.",
            scope="fleet_check",
            panel=PANEL_OUT,
        ),
    ] = False,
    auth_token_file: options.AuthTokenFile = None,
    endpoints: Endpoints = None,
    peer: Peers = None,
    **p: object,  # options.REGISTRY
) -> None:
    from kvpush.commands.fleet import render as views
    from kvpush.commands.fleet.check import CheckConfig, check_fleet
    from kvpush.commands.fleet.warm import warm_pairs

    cfg = CheckConfig(
        pushes=pushes,
        size_bytes=parse_size(size),
        concurrency=concurrency,
        deadline_s=deadline,
        strict=strict,
        auth_token=translate.auth_token(auth_token_file),
    )
    src = fleet_source(p, endpoints, peer, concurrency, auth_token_file)
    etcd = src.open()
    listed = src.list(etcd)
    records = listed.records
    err = Console(stderr=True, highlight=False)
    n_p = sum(1 for r in records if r.role == Role.PREFILL)
    if not json_out:
        err.print(
            f"fleet check: {n_p} P x {len(records) - n_p} D of cluster {src.cluster}, "
            f"{cfg.concurrency} pairs at a time",
            soft_wrap=True,
        )
    if not json_out:
        _warn(listed.problems)
    rep = check_fleet(src.cluster, records, cfg, relist=lambda: src.list(etcd).records)
    status = int(rep.exit_status) if rep.pairs else int(ExitStatus.OK)
    if listed.unseen:
        status = max(status, int(ExitStatus.NOT_READY))
    warmed = warm_pairs(rep, records, cfg) if warm else None
    if warmed is not None and warmed.cold:
        status = max(status, int(ExitStatus.NOT_READY))
    if json_out:
        out = views.check_json(rep)
        if warmed is not None:
            out["warm"] = warmed.to_dict()
        out["problems"] = listed.problems
        out["unseen"] = listed.unseen
        out["exit_status"] = status
        stdio.out(json.dumps(out))
    else:
        _print(lambda w: views.check_text(rep, w))
        for line in warmed.lines() if warmed is not None else []:
            stdio.out(shown(line))
        if listed.unseen:
            stdio.err(f"fleet check: {listed.unseen} listed endpoint(s) could not be seen (above)")
    raise typer.Exit(status)
