"""``kvpush drive``: act as the router and put load through running P and D endpoints.

Options -> ``kvpush.ops.driver.Driver`` -> a progress bar on a terminal, or a progress line on
stderr every few seconds when stderr is not one; peer events (down, back up) as they happen
-> the summary for a person (``views.reports``) or one JSON object. The first SIGINT, SIGTERM
or SIGHUP stops intake and gives in-flight requests a short grace, a second ends the grace:
the partial summary is printed (every request accounted for) and the exit status is 130.
Otherwise 0 only when every request succeeded and verified, else 1. Runs on the main thread;
the driver owns its worker threads.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console

from kvpush.cli import options, stdio, translate
from kvpush.cli.signals import StopFlag
from kvpush.cli.views import reports
from kvpush.errors import ExitStatus

DOC = """Act as the router: send both legs of N requests to running P and D endpoints.

For each request the decode leg goes to the next D that is up (round robin) and the prefill
leg to the next P, both in flight together. A peer that refuses connections or misses a
liveness check is marked down at once and traffic goes to the others; it is re-checked and
comes back. Ends with ok/failed counts, failures by reason, latency percentiles, throughput
and whether every byte verified; every request is accounted for. Ctrl-C stops intake, waits
briefly for requests in flight and prints the partial summary (exit 130). Exit status 0 when
all requests succeeded and verified, 1 otherwise."""

PROGRESS_EVERY_S = 3.0


def register(app: typer.Typer) -> None:
    options.register(app, "drive", drive, options.DRIVE, DOC)


def drive(
    ctx: typer.Context,
    prefill: list[str],
    decode: list[str],
    requests: int,
    concurrency: int,
    rate: float | None,
    blocks: int,
    timeout: float,
    json_out: bool,
    auth_token_file: str | None,
) -> None:
    from kvpush.ops.driver import DriveConfig, Driver

    cfg = DriveConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        requests=requests,
        concurrency=concurrency,
        rate=rate,
        blocks=blocks,
        timeout_s=timeout,
        auth_token=translate.auth_token(auth_token_file),
    )
    err = Console(stderr=True, highlight=False)

    def event(text: str) -> None:
        err.print(f"drive: {text}")

    tty = sys.stderr.isatty() and not json_out
    driver: Any = None

    def tick() -> None:
        if not tty:
            done, ok, failed = driver.progress()
            err.print(
                reports.drive_progress_line(
                    done, ok, failed, driver.in_flight(), requests, driver.health.rows()
                )
            )

    advance: list[Any] = [lambda r: None]  # the progress bar's, once it exists
    driver = Driver(
        cfg,
        on_result=lambda r: advance[0](r),
        on_event=event,
        on_tick=tick,
        tick_s=PROGRESS_EVERY_S,
    )
    stop = StopFlag(on_signal=driver.cancel).install()
    try:
        if tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=err,
                transient=True,
            ) as bar:
                task = bar.add_task("requests", total=requests)
                advance[0] = lambda r: bar.advance(task)
                report = driver.run()
        else:
            report = driver.run()
    finally:
        stop.restore()
    for note in report.notes:
        err.print(f"drive: note: {note}")
    if report.interrupted:
        err.print(
            f"drive: interrupted ({stop.signame or 'cancelled'}): intake stopped; the summary "
            "counts requests never sent and those still in flight as cancelled"
        )
    if json_out:
        stdio.out(json.dumps(report.to_dict()))
    else:
        Console().print(reports.drive_summary(report), soft_wrap=True)
    if report.interrupted:
        raise typer.Exit(int(ExitStatus.INTERRUPTED))
    raise typer.Exit(0 if report.all_verified else 1)
