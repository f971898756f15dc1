"""``kvpush drive``: act as the router and put load through running P and D endpoints.

Options -> ``kvpush.ops.driver.Driver`` -> a progress bar on a terminal, the summary for a
person (``views.reports``) or one JSON object. Exit status 0 only when every request
succeeded and verified. Runs on the main thread; the driver owns its worker threads.
"""

from __future__ import annotations

import json
import sys

import typer

from kvpush.cli import options, stdio, translate

DOC = """Act as the router: send both legs of N requests to running P and D endpoints.

For each request the decode leg goes to the next D (round robin) and the prefill leg to the
next P, both in flight together. Ends with ok/failed counts, failures by reason, latency
percentiles, throughput and whether every byte verified. Exit status 0 when all requests
succeeded and verified, 1 otherwise."""


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
    if not json_out and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task("requests", total=requests)
            report = Driver(cfg, on_result=lambda r: bar.advance(task)).run()
    else:
        report = Driver(cfg).run()
    if json_out:
        stdio.out(json.dumps(report.to_dict()))
    else:
        from rich.console import Console

        from kvpush.cli.views.reports import drive_summary

        Console().print(drive_summary(report), soft_wrap=True)
    raise typer.Exit(0 if report.all_verified else 1)
