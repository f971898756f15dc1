"""``kvpush demo``: one P and two D endpoints on loopback, a few hundred requests through them.

Options -> ``kvpush.commands.demo.demo.Demo`` (child processes, a driver, a third D midway) -> P's
live telemetry or progress lines on stderr while it runs -> the summary (``view``) or one
JSON object. Exit status 0 when everything succeeded, 130 when a signal stopped it (children
stopped, work directory removed unless --keep-logs). Runs on the main thread; the demo owns its
children and its driver thread.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, RenderableType

from kvpush.commands.common import options
from kvpush.commands.common.ending import finish
from kvpush.commands.common.optspec import option
from kvpush.commands.demo import view as reports
from kvpush.errors import ConfigError
from kvpush.runtime.signals import StopFlag

if TYPE_CHECKING:
    from kvpush.commands.demo.demo import Demo

DOC = """Start one P and two D endpoints on loopback, push a few hundred requests through them.

The endpoints run as separate processes. Midway a third D starts and joins the rotation
(its first push needs a new handshake, which must not stall the others). Every byte is
verified; the endpoints are stopped with SIGTERM. SIGINT, SIGTERM or SIGHUP stop the demo
early: intake stops, every endpoint is stopped, the work directory is removed (unless
--keep-logs) and the exit status is 130. Exit status 0 when everything succeeded."""


def parse_tp_shape(text: str) -> tuple[int, int]:
    """``--tp N`` (P and D) or ``--tp P,D``."""
    parts = [t.strip() for t in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"invalid --tp {text!r}", "give N (P and D) or P,D, e.g. --tp 2,1")
    return int(parts[0]), int(parts[1])


def register(app: typer.Typer) -> None:
    options.register(app, "demo", demo, DOC)


def demo(
    requests: Annotated[int, option("--requests", "-n", help="Requests to drive.")] = 300,
    blocks: options.Blocks = 4,
    decoders: Annotated[int, option("--decoders", help="Decode endpoints at start.")] = 2,
    tp_shape: Annotated[
        str,
        option(
            "--tp",
            help="Tensor-parallel ranks of P and of each D: N for both, or P,D (e.g. 4,2 or "
            "1,4; the demo model has 4 KV heads, so 1, 2 or 4).",
            scope="demo",
            metavar="N|P,D",
        ),
    ] = "1",
    shape: options.Shape = None,
    concurrency: options.Concurrency = 8,
    live: Annotated[
        bool | None,
        option(
            "--live/--no-live",
            help="Show P's live telemetry while driving (default: when stderr is a terminal).",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[
        bool, option("--json", help="One JSON report on stdout.", scope="demo")
    ] = False,
    keep_logs: Annotated[
        bool, option("--keep-logs", help="Keep the endpoints' logs (kept anyway on failure).")
    ] = False,
) -> None:
    from kvpush.commands.demo.demo import Demo, DemoConfig

    p_tp, d_tp = parse_tp_shape(tp_shape)
    cfg = DemoConfig(
        requests=requests,
        blocks=blocks,
        decoders=decoders,
        concurrency=concurrency,
        p_tp=p_tp,
        d_tp=d_tp,
        shape=shape or "",
    )
    show_live = (sys.stderr.isatty() and not json_out) if live is None else live
    d = Demo(cfg)
    stop = StopFlag(on_signal=d.cancel).install()
    err = Console(stderr=True, highlight=False)
    try:
        try:
            _run(d, show_live, quiet=json_out)
            report = d.finish(keep_logs=True if keep_logs else None)
        except BaseException:
            kept = d.abort(keep_logs=keep_logs)
            err.print(f"demo: endpoints stopped; {_logs(kept, d.workdir)}")
            raise
    finally:
        stop.restore()
    if report.interrupted:
        err.print(
            f"demo: interrupted by {stop.signame}: endpoints stopped; "
            f"{_logs(report.kept_logs, d.workdir)}"
        )
    finish(report, reports.demo_summary, json_out, ok=report.ok, interrupted=report.interrupted)


def _logs(kept: bool, workdir: Path) -> str:
    return f"logs kept in {workdir}" if kept else "work directory removed"


def _run(d: Demo, show_live: bool, quiet: bool) -> None:
    con = Console(stderr=True)
    if not quiet:
        con.print(
            f"demo: starting 1 prefill and {d.cfg.decoders} decode endpoints "
            f"(work dir {d.workdir})",
            highlight=False,
        )
    d.start()
    d.start_driving()

    def view() -> RenderableType:
        return reports.demo_view(d.progress(), d.cfg.requests, d.events, d.prefill_stats())

    if show_live:
        from rich.live import Live

        with Live(view(), console=con, refresh_per_second=4) as lv:
            while not d.done(0.25):
                lv.update(view())
            lv.update(view())
        return
    seen = 0
    last = 0.0
    while not d.done(0.2):
        if quiet:
            continue
        for e in d.events[seen:]:
            con.print(f"demo: {e}", highlight=False)
        seen = len(d.events)
        if time.monotonic() - last > 2.0:
            con.print(reports.demo_progress_line(d.progress(), d.cfg.requests), highlight=False)
            last = time.monotonic()
