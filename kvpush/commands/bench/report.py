"""Benchmark results: one JSON-able structure per scenario, and the cell formatters its tables use.

``Report`` collects what a scenario measured: tables for people (cells already formatted, with
``fmt_ms``, ``fmt_x``, ``fmt_num``), ``figures`` for machines (plain numbers), ``targets`` (what
the issue asks for, what was measured, met or not: a miss is reported, never hidden) and chart
files. ``Report.to_dict()`` is the scenario's JSON (NaN and inf become ``null``); it is rendered
as text or markdown by ``kvpush.commands.bench.render``, and the charts are drawn by
``kvpush.commands.bench.chart``. ``machine_info`` describes the host, including its load average:
numbers from a busy host are not comparable with a quiet one.

Runs in the orchestrator process, on the thread that runs the scenario (never in a worker).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NotRequired, TypedDict

from kvpush.commands.bench.stats import finite


def fmt_ms(seconds: float | None, digits: int = 2) -> str:
    if seconds is None or (isinstance(seconds, float) and not math.isfinite(seconds)):
        return "-"
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.{digits}f}"


def fmt_x(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def fmt_num(x: float | None, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:,.{digits}f}"


class TableDict(TypedDict):
    """One table of a result: cells already formatted."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str


class TargetDict(TypedDict):
    """One target of a result: what was asked, what was measured, met or not."""

    name: str
    target: str
    measured: str
    met: bool | None
    note: str


Package = Literal["nixl", "torch", "numpy", "pyzmq", "kvpush"]
PACKAGES: tuple[Package, ...] = ("nixl", "torch", "numpy", "pyzmq", "kvpush")


class Machine(TypedDict):
    """The host a result was measured on (``machine_info``; ``loadavg_end`` added at the end)."""

    cpus: int | None
    kernel: str
    python: str
    loadavg: list[float]
    cpu: NotRequired[str]
    mem_gib: NotRequired[float]
    nixl: NotRequired[str]
    torch: NotRequired[str]
    numpy: NotRequired[str]
    pyzmq: NotRequired[str]
    kvpush: NotRequired[str]
    ucx_tls: NotRequired[str]
    loadavg_end: NotRequired[list[float]]


class ResultDict(TypedDict):
    """A scenario's result: ``Report.to_dict()``, plus the host's noise over the run (added by
    ``kvpush.commands.bench.run``); ``figures`` and ``data`` are for machines, never read here."""

    scenario: str
    title: str
    quick: bool
    command: str
    started_at: str
    elapsed_s: float
    machine: Machine
    params: dict[str, object]
    tables: list[TableDict]
    targets: list[TargetDict]
    notes: list[str]
    figures: object
    charts: list[str]
    data: object
    host_noise: NotRequired[dict[str, object]]


@dataclass
class Report:
    scenario: str
    title: str
    quick: bool
    params: dict[str, object] = field(default_factory=dict)
    tables: list[TableDict] = field(default_factory=list)
    targets: list[TargetDict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)
    charts: list[str] = field(default_factory=list)
    data: dict[str, object] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    machine_start: Machine = field(default_factory=lambda: machine_info())

    def table(
        self, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], note: str = ""
    ) -> None:
        self.tables.append(
            {
                "title": title,
                "columns": list(columns),
                "rows": [[str(c) for c in r] for r in rows],
                "note": note,
            }
        )

    def target(
        self, name: str, target: str, measured: str, met: bool | None, note: str = ""
    ) -> None:
        self.targets.append(
            {"name": name, "target": target, "measured": measured, "met": met, "note": note}
        )

    def to_dict(self) -> ResultDict:
        end = machine_info()
        return {
            "scenario": self.scenario,
            "title": self.title,
            "quick": self.quick,
            "command": f"kvpush bench {self.scenario}" + (" --quick" if self.quick else ""),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "elapsed_s": round(time.time() - self.started, 2),
            "machine": {**self.machine_start, "loadavg_end": end["loadavg"]},
            "params": self.params,
            "tables": self.tables,
            "targets": self.targets,
            "notes": self.notes,
            "figures": _clean(self.figures),
            "charts": self.charts,
            "data": _clean(self.data),
        }


def _clean(x: object) -> object:
    """NaN/inf -> None, tuples -> lists, recursively (strict JSON)."""
    if isinstance(x, float):
        return finite(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def machine_info() -> Machine:
    info: Machine = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["mem_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in PACKAGES:
        with contextlib.suppress(PackageNotFoundError):
            info[pkg] = version(pkg)
    info["ucx_tls"] = os.environ.get("UCX_TLS", "(unset)")
    return info
