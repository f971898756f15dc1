"""When each request of a drive is due, how many blocks it asks for, and whether it may go.

Owns the ``Schedule`` a ``Driver`` is handed (the instruments of its intake): ``Steady`` is
plain drive's -- every request ``--blocks``, request ``i`` due ``i / --rate`` seconds after the
start (at once without a rate) -- and ``kvpush.commands.drive.workload.TraceSchedule`` is
``drive --workload``'s (each request at its timestamp, its blocks from its prompt). The driver
calls ``begin`` once before the first request (its clock's start and the pools the preflight
saw), then per request, on the worker that sends it: ``due``, ``started`` once the worker
begins it (how late it is), ``refuse`` (a reason to fail it unsent) and ``blocks``.

Threads: ``begin`` on the thread of ``Driver.run``, the rest on drive's workers; a schedule that
keeps state guards it itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpush.commands.common.results import DriveConfig
from kvpush.telemetry.names import Failure


@dataclass(frozen=True)
class Pools:
    """Each endpoint's pool, in blocks per rank (what one request's blocks come out of), as the
    preflight saw them: by address, per role."""

    prefill: Mapping[str, int]
    decode: Mapping[str, int]


class Schedule(Protocol):
    def begin(self, t0: float, pools: Pools) -> None:
        """The run starts at ``t0`` (``time.monotonic``); ``pools`` as the preflight saw them."""

    def due(self, i: int) -> float | None:
        """Seconds after the start at which request ``i`` is due (None: at once)."""

    def started(self, i: int, late_s: float) -> None:
        """A worker begins request ``i``, ``late_s`` after it was due."""

    def refuse(self, i: int) -> tuple[Failure, str] | None:
        """Why request ``i`` fails without being sent (None: it goes)."""

    def blocks(self, i: int) -> int:
        """The blocks request ``i`` asks for (per rank)."""


class Steady:
    """Plain drive: ``cfg.blocks`` per request, ``cfg.rate`` requests started per second."""

    def __init__(self, cfg: DriveConfig) -> None:
        self._blocks = cfg.blocks
        self._rate = cfg.rate

    def begin(self, t0: float, pools: Pools) -> None:
        return None

    def due(self, i: int) -> float | None:
        return i / self._rate if self._rate else None

    def started(self, i: int, late_s: float) -> None:
        return None

    def refuse(self, i: int) -> tuple[Failure, str] | None:
        return None

    def blocks(self, i: int) -> int:
        return self._blocks
