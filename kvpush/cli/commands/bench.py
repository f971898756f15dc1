"""``kvpush bench SCENARIO``: run benchmark scenarios and print their tables (or JSON).

Options -> ``kvpush.bench.console.run_scenarios`` (the same code ``python -m kvpush.bench``
runs) -> text or JSON on stdout, progress on stderr. A missed target is a result, not an
error: it is printed as MISSED and the exit status stays 0. Runs on the main thread; the
scenarios start and stop their own worker processes.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvpush.cli import options

DOC = """Measure kvpush against its baselines, in one run, on this host.

Every scenario starts real P and D endpoint processes on 127.0.0.1 (and raw NIXL baselines
where it compares with one) and stops them when it ends. Compare the ratios it prints, not
absolute times from different runs or hosts. 'kvpush bench all' takes about 15 minutes here;
BENCHMARKS.md explains each scenario and holds a full run. 'kvpush bench device --device cuda'
pushes between VRAM pools (not part of 'all'; scripts/gpu-check.sh runs it)."""


def register(app: typer.Typer) -> None:
    options.register(app, "bench", bench, options.BENCH, DOC)


def bench(
    ctx: typer.Context,
    scenario: str,
    quick: bool,
    json_out: bool,
    out_dir: Path | None,
    device: str = "cpu",
) -> None:
    from kvpush.bench.console import run_scenarios

    run_scenarios(scenario, quick, json_out, out_dir, device)
