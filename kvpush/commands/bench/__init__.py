"""``kvpush bench``: each claim of kvpush measured beside its baseline, in the same run.

Scenarios (one module each; every one starts real P and D processes on 127.0.0.1 through
``kvpush.commands.bench.procs`` and kills them all when it ends, however it ends):

- ``hol``: pushes to an established D while new Ds with slow or dead handshakes join, with the
  deferred and the blocking writer;
- ``handshake``: D->P notif-only vs full handshakes against P pools of 1k..1M descriptors, and
  the agent metadata over the side channel vs through NIXL's etcd backend;
- ``bandwidth``: end-to-end push GB/s vs a raw NIXL WRITE loop, ``process_vm_writev`` and memcpy;
- ``rate``: small pushes per second vs a raw pipelined NIXL WRITE+notif loop, and the
  notifications of both beside raw NIXL's notifications and UCX's own floors (``ucx_perftest``);
- ``scale``: a storm of new D endpoints joining while established pushes continue;
- ``tp``: aggregate push bandwidth of N tensor-parallel ranks vs N x one rank (and N processes);
- ``model``: pushes at real model geometry (``kvpush.memory.shapes``) with block ids contiguous,
  shuffled and as churn leaves a pool (kvpush's extent allocator vs a plain free list), beside
  raw NIXL (merge on and off) and ``process_vm_writev`` of the same ids; allocation cost;
- ``fleet``: 8 Ps and 16 Ds registered in etcd: ``fleet ls``/``watch`` start-up, ``fleet check``
  of growing grids up to all 128 pairs, etcd's request rate, push p99 registration on vs off.
- ``device`` (not in ``all``): pushes at model shapes between pools on ``--device`` (``cuda``:
  VRAM) beside a raw NIXL WRITE loop and a torch copy of the same bytes (``scripts/gpu-check.sh``).

``run(name, quick, out_dir, progress)`` returns one scenario's result as a JSON-able dict
(``kvpush.commands.bench.report``); ``run_all`` runs every scenario. Importing this package is
cheap: the scenario modules (and with them torch/nixl, only ever inside worker processes) load on
use.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.commands.bench.report import ResultDict

SCENARIOS: tuple[str, ...] = (
    "hol", "handshake", "bandwidth", "rate", "scale", "tp", "model", "fleet",
)  # fmt: skip
#: Scenarios that take ``device`` (``--device``); not run by ``all``.
DEVICE_SCENARIOS: tuple[str, ...] = ("device",)
NAMES: tuple[str, ...] = SCENARIOS + DEVICE_SCENARIOS

DEFAULT_OUT_DIR = Path("bench-out")


def _quiet(msg: str) -> None:
    pass


def check_name(name: str, also: tuple[str, ...] = ()) -> None:
    """Refuse a scenario name that is none of ``NAMES`` (nor ``also``: what the caller runs
    itself, e.g. the command's ``trace`` and ``peer``), naming every one it takes."""
    if name not in NAMES and name not in also:
        from kvpush.errors import ConfigError

        raise ConfigError(
            f"unknown benchmark scenario {name!r}",
            f"choose one of {', '.join((*NAMES, *also))}, or all",
        )


def run(
    name: str,
    quick: bool = False,
    out_dir: Path | None = None,
    progress: Callable[[str], None] = _quiet,
    device: str = "cpu",
) -> ResultDict:
    """Run one scenario; write ``<out_dir>/<name>.json`` (and its chart); return the result.
    ``device`` is for the ``DEVICE_SCENARIOS``; the others run on DRAM only."""
    from kvpush.errors import ConfigError

    check_name(name)
    if device != "cpu" and name not in DEVICE_SCENARIOS:
        raise ConfigError(
            f"bench {name} runs on DRAM only (--device {device})",
            f"--device applies to {', '.join(DEVICE_SCENARIOS)}: "
            f"kvpush bench device --device {device}",
        )
    out = out_dir if out_dir is not None else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    from kvpush.commands.bench.noise import HostMonitor

    mod = importlib.import_module(f"kvpush.commands.bench.{name}")
    monitor = HostMonitor().start()
    try:
        kw = {"device": device} if name in DEVICE_SCENARIOS else {}
        result: ResultDict = mod.run(quick, out, progress, **kw)
    finally:
        noise = monitor.stop()
    result["host_noise"] = noise
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def run_all(
    quick: bool = False,
    out_dir: Path | None = None,
    progress: Callable[[str], None] = _quiet,
    on_result: Callable[[ResultDict], None] | None = None,
) -> list[ResultDict]:
    """Run every scenario in turn; also write ``<out_dir>/summary.md`` (markdown tables of all)."""
    from kvpush.commands.bench.render import render_summary

    out = out_dir if out_dir is not None else DEFAULT_OUT_DIR
    results = []
    for name in SCENARIOS:
        r = run(name, quick, out, progress)
        if on_result is not None:
            on_result(r)
        results.append(r)
    (out / "summary.md").write_text(render_summary(results))
    return results
