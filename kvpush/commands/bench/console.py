"""Run benchmark scenarios and print them: the body of ``kvpush bench`` and ``python -m
kvpush.commands.bench``.

Owns ``run_scenarios`` (scenario names -> ``kvpush.commands.bench.run`` / ``run_all`` -> text tables
or JSON lines on stdout, progress on stderr; raises typed errors) and ``run_bench`` (the same with
errors as ``error:``/``hint:`` lines and an exit status, for ``python -m kvpush.commands.bench``,
which must not import the CLI). Runs on the caller's thread.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.errors import ConfigError, ExitStatus, KvpushError

if TYPE_CHECKING:
    from kvpush.commands.bench.report import ResultDict


def run_scenarios(
    scenario: str, quick: bool, json_out: bool, out_dir: Path | None, device: str = "cpu"
) -> None:
    from kvpush.commands import bench as b
    from kvpush.commands.bench.render import render_text

    names = b.SCENARIOS if scenario == "all" else (scenario,)
    if scenario != "all":
        b.check_name(scenario)
    if scenario == "all" and device != "cpu":
        raise ConfigError(
            f"bench all runs on DRAM only (--device {device})",
            f"--device applies to {', '.join(b.DEVICE_SCENARIOS)}: "
            f"kvpush bench device --device {device}",
        )

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    first = True

    def show(result: ResultDict) -> None:
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
            show(b.run(name, quick, out_dir, progress, device))


def run_bench(
    scenario: str, quick: bool, json_out: bool, out_dir: Path | None, device: str = "cpu"
) -> int:
    """``run_scenarios`` with errors translated to ``error:``/``hint:`` lines and a status."""
    try:
        run_scenarios(scenario, quick, json_out, out_dir, device)
    except KvpushError as e:
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return int(e.exit_status)
    except KeyboardInterrupt:
        return int(ExitStatus.INTERRUPTED)
    return 0
