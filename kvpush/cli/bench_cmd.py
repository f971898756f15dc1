"""``kvpush bench SCENARIO``: run benchmark scenarios and print their tables (or JSON).

CLI layer only: options -> ``kvpush.bench.run`` (imported inside the command, so importing the
CLI stays light) -> text or JSON on stdout, progress on stderr. Library errors are typed
``KvpushError``s; the app's error handler turns them into ``error:``/``hint:`` and an exit
status (``run_bench`` does the same for ``python -m kvpush.bench``). A missed target is a
result, not an error: it is printed as MISSED and the exit status stays 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvpush.errors import ExitStatus, KvpushError

SCENARIO_HELP = (
    "hol (head-of-line behind a slow new peer, deferred vs blocking writer), handshake "
    "(notif-only vs full), bandwidth (push GB/s vs raw NIXL, process_vm_writev, memcpy), rate "
    "(small pushes/s vs raw NIXL), scale (many new peers at once), model (real model shapes, "
    "block ids contiguous, shuffled and after churn, vs raw NIXL), or all."
)


def bench(
    scenario: Annotated[str, typer.Argument(help=SCENARIO_HELP, show_default=False)],
    quick: Annotated[
        bool, typer.Option("--quick", help="Short smoke version (what CI runs); figures are rough.")
    ] = False,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json", help="Print each scenario's full result as one JSON line instead of tables."
        ),
    ] = False,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out-dir",
            help="Where results (<scenario>.json), charts (.svg) and worker logs go. "
            "[default: ./bench-out]",
            file_okay=False,
        ),
    ] = None,
) -> None:
    """Measure kvpush against its baselines, in one run, on this host.

    Every scenario starts real P and D endpoint processes on 127.0.0.1 (and raw NIXL baselines
    where it compares with one) and stops them when it ends. Compare the ratios it prints, not
    absolute times from different runs or hosts. 'kvpush bench all' takes about 13 minutes here;
    BENCHMARKS.md explains each scenario and holds a full run.
    """
    _bench(scenario, quick, json_out, out_dir)


def _bench(scenario: str, quick: bool, json_out: bool, out_dir: Path | None) -> None:
    from kvpush import bench as b
    from kvpush.bench.report import render_text
    from kvpush.errors import ConfigError

    names = b.SCENARIOS if scenario == "all" else (scenario,)
    if scenario != "all" and scenario not in b.SCENARIOS:
        raise ConfigError(
            f"unknown benchmark scenario {scenario!r}",
            f"choose one of {', '.join(b.SCENARIOS)}, or all",
        )

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    first = True

    def show(result: dict[str, object]) -> None:
        nonlocal first
        if json_out:
            print(json.dumps(result), flush=True)
        else:
            if not first:
                print()
            print(render_text(result), flush=True)
        first = False

    if scenario == "all":
        b.run_all(quick, out_dir, progress, on_result=show)
    else:
        for name in names:
            show(b.run(name, quick, out_dir, progress))


def run_bench(scenario: str, quick: bool, json_out: bool, out_dir: Path | None) -> int:
    """``_bench`` with errors translated to ``error:``/``hint:`` lines and an exit status."""
    try:
        _bench(scenario, quick, json_out, out_dir)
    except KvpushError as e:
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return int(e.exit_status)
    except KeyboardInterrupt:
        return int(ExitStatus.INTERRUPTED)
    return 0
