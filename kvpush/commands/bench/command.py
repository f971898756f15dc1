"""``kvpush bench SCENARIO``: run benchmark scenarios and print their tables (or JSON).

Options -> ``kvpush.commands.bench.console.run_scenarios`` (the same code ``python -m
kvpush.commands.bench`` runs) -> text or JSON on stdout, progress on stderr. A missed target is a
result, not an error: it is printed as MISSED and the exit status stays 0. Runs on the main thread;
the scenarios start and stop their own worker processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvpush.commands.common import complete, options
from kvpush.commands.common.optspec import option

DOC = """Measure kvpush against its baselines, in one run, on this host.

Every scenario starts real P and D endpoint processes on 127.0.0.1 (and raw NIXL baselines
where it compares with one) and stops them when it ends. Compare the ratios it prints, not
absolute times from different runs or hosts. 'kvpush bench all' takes about 15 minutes here;
BENCHMARKS.md explains each scenario and holds a full run. 'kvpush bench device --device cuda'
pushes between VRAM pools (not part of 'all'; scripts/gpu-check.sh runs it)."""


def scenarios(incomplete: str) -> list[str]:
    """Tab-completion of the scenario (runs on every Tab press: the bench package is light)."""
    from kvpush.commands.bench import NAMES

    return complete.starting([*NAMES, "trace", "peer", "all"], incomplete)


def register(app: typer.Typer) -> None:
    options.register(app, "bench", bench, DOC)


def bench(
    scenario: Annotated[
        str,
        typer.Argument(
            help="hol (head-of-line behind a slow new peer, deferred vs blocking writer), "
            "handshake (notif-only vs full; agent metadata over the side channel vs etcd), "
            "bandwidth (push GB/s vs raw NIXL, process_vm_writev, memcpy), rate (small "
            "pushes/s and notifications/s vs raw NIXL and UCX's own floors), scale (many new "
            "peers at once), tp (N ranks vs N x one rank), model (real model shapes, block "
            "ids contiguous, shuffled and after churn, vs raw NIXL), fleet (8 P x 16 D "
            "registered in etcd: fleet ls/watch/check, registry load, p99 with registration "
            "on vs off), or all; device (--device cuda: pushes between VRAM pools vs raw NIXL"
            " and a torch copy; not part of all); trace (a request trace replayed at rising "
            "speedups: the knee for a pair and for 1 P x 2 D, with the pool each step needed;"
            " --workload FILE or a synthetic one; not part of all); peer (kvpush P -> D "
            "beside vLLM P -> D with vLLM's own NixlPushConnector: requests/s, latency, CPU "
            "per request; needs --vllm-python; not part of all).",
            show_default=False,
            autocompletion=scenarios,
        ),
    ],
    quick: Annotated[
        bool, option("--quick", help="Short smoke version (what CI runs); figures are rough.")
    ] = False,
    json_out: Annotated[
        bool,
        option(
            "--json",
            help="Print each scenario's full result as one JSON line instead of tables.",
            scope="bench",
        ),
    ] = False,
    out_dir: Annotated[
        Path | None,
        option(
            "--out-dir",
            help="Where results (<scenario>.json), charts (.svg) and worker logs go. "
            "[default: ./bench-out]",
            file_okay=False,
        ),
    ] = None,
    device: Annotated[str, options.OPTIONS["device"].info()] = "cpu",
    workload: Annotated[
        str | None,
        option(
            "--workload",
            help="bench trace: the Mooncake-format trace to sweep (default: a synthetic "
            "conversation-like one).",
            scope="bench",
            metavar="FILE",
            show_default=False,
        ),
    ] = None,
    vllm_python: Annotated[
        str | None,
        option(
            "--vllm-python",
            help="bench peer: the python of the vLLM virtualenv (scripts/vllm-venv.sh builds "
            "it and prints its path). [default: $KVPUSH_VLLM_PYTHON]",
            env=False,
            metavar="PATH",
            show_default=False,
        ),
    ] = None,
    requests: Annotated[
        int | None,
        option(
            "--requests",
            help="bench peer: requests per round of the 1-block, 16-in-flight cell; the other "
            "cells scale with it. [default: 600; --quick: 64]",
            env=False,
            show_default=False,
        ),
    ] = None,
    rounds: Annotated[
        int | None,
        option(
            "--rounds",
            help="bench peer: rounds (each runs every cell on both systems, the order "
            "alternating). [default: 3; --quick: 1]",
            env=False,
            show_default=False,
        ),
    ] = None,
) -> None:
    from kvpush.commands.bench.console import run_scenarios

    if scenario == "peer":
        from kvpush.commands.bench.peer import run_peer

        return run_peer(quick, json_out, out_dir, vllm_python, requests, rounds)
    if vllm_python is not None or requests is not None or rounds is not None:
        from kvpush.errors import ConfigError

        raise ConfigError(
            "--vllm-python, --requests and --rounds are for 'kvpush bench peer'",
            "drop them, or run bench peer",
        )
    if scenario == "trace":
        from kvpush.commands.bench.trace import run_trace

        return run_trace(quick, json_out, out_dir, workload)
    if workload is not None:
        from kvpush.errors import ConfigError

        raise ConfigError("--workload is for 'kvpush bench trace'", "drop it, or run bench trace")

    from kvpush.commands.bench import check_name

    if scenario != "all":
        check_name(scenario, also=("trace", "peer"))  # (this command runs those two itself)
    run_scenarios(scenario, quick, json_out, out_dir, device)
