"""Probes that run *inside* an endpoint process (a bench worker): what a scenario reads from an
endpoint besides its load generators' results (``kvpush.commands.bench.loadgen``).

The endpoint's telemetry snapshot (``stats``), repeated handshakes with their phase timings
(``handshake_series``), the bytes of its handshake metadata (``metadata_sizes``), CPU seconds of
the process and of the endpoint's owner threads (``cpu``; ``process_cpu_s`` and
``threads_cpu_s`` are also what the generators and the raw loops measure with) and the
garbage collector's pauses (``gc_watch`` / ``gc_report``).

Threads: the calling command thread; the GC callback runs on whichever thread collects.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import NotRequired, TypedDict

import msgspec

from kvpush.commands.bench.worker_state import WorkerState
from kvpush.config import HandshakeMode
from kvpush.stats_schema import HistSnapshot


class GcGeneration(TypedDict):
    count: int
    total_s: float
    max_s: float


class GcReport(TypedDict):
    """The reply of ``gc_report``."""

    tracked_objects: int
    frozen_objects: int
    gen0: GcGeneration
    gen1: GcGeneration
    gen2: GcGeneration
    slowest: list[list[float]]  # [wall time, generation, seconds], slowest first


#: One histogram of ``stats`` as the reply's JSON carries it; ``histogram`` reads it.
HistJson = dict[str, object]


def histogram(raw: HistJson) -> HistSnapshot:
    """One histogram of a ``stats`` reply, decoded as the schema its producer, the endpoint's
    telemetry, encodes (``kvpush.stats_schema``): seconds, and sparse cumulative buckets.

    Raises ``msgspec.ValidationError`` when the reply does not follow it.
    """
    return msgspec.convert(raw, HistSnapshot)


class LaneReply(TypedDict, total=False):
    """What the scenarios read of a P peer row's ``lane`` (``kvpush.prefill.lanestats``)."""

    pushes: int
    post_us_per_desc: float


class PeerReply(TypedDict):
    """What the scenarios read of one peer row of ``stats`` (``kvpush.peers.table``)."""

    peer: str
    state: str
    duration_s: float
    lane: NotRequired[LaneReply]


class StatsReply(TypedDict):
    """What the scenarios read of ``stats``' answer: the endpoint's telemetry snapshot
    (``Snapshot.to_dict``, more keys than these)."""

    counters: dict[str, int]
    histograms: dict[str, HistJson]
    peers: list[PeerReply]


#: The reply of ``handshake_series``: per mode, one row of phase timings (s) per handshake.
HandshakeSeries = dict[str, list[dict[str, float]]]

_SC_CLK_TCK = os.sysconf("SC_CLK_TCK")


def stats(state: WorkerState) -> dict[str, object]:
    return state.endpoint.get().snapshot().to_dict()


def handshake_series(
    state: WorkerState, p_addr: str, modes: list[str], repeats: int, settle_s: float = 0.0
) -> HandshakeSeries:
    """Handshake to ``p_addr`` ``repeats`` times per mode (interleaved), forgetting the peer
    after each so the next one starts from nothing. Returns phase timings per mode."""
    ep = state.endpoint.get()
    out: HandshakeSeries = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            t0 = time.perf_counter()
            conn = ep.handshake_to(p_addr, HandshakeMode(m))
            wall = time.perf_counter() - t0
            row = dict(conn.timings)
            row["call_s"] = wall
            out[m].append(row)
            ep.forget_handshake(p_addr)
            if settle_s:
                time.sleep(settle_s)
    return out


def metadata_sizes(state: WorkerState) -> dict[str, int]:
    """Bytes this endpoint sends in a handshake reply: its NIXL agent metadata in each mode
    and kvpush's own endpoint metadata."""
    return state.endpoint.get().metadata_sizes()


def process_cpu_s() -> float:
    """CPU seconds of this process (all threads), ns resolution (``os.times`` ticks 10 ms)."""
    return time.process_time()


def _thread_cpu_s(tid: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            return (int(parts[11]) + int(parts[12])) / _SC_CLK_TCK
        except (OSError, ValueError, IndexError):
            return None


def threads_cpu_s(state: WorkerState) -> dict[str, float]:
    """CPU seconds of the endpoint's owner threads (P's writer, D's receiver) and the process."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.name in (
            "push-writer",
            "decode-receiver",
            "sidechannel-prefill",
            "sidechannel-decode",
        ):
            v = _thread_cpu_s(t.native_id or 0)
            if v is not None:
                out[t.name] = v
        elif t.name.startswith("completer"):
            v = _thread_cpu_s(t.native_id or 0)
            if v is not None:
                out["completer"] = out.get("completer", 0.0) + v
    out["process"] = process_cpu_s()
    return out


def cpu(state: WorkerState) -> dict[str, float]:
    return threads_cpu_s(state)


# --------------------------------------------------------------------------- GC pauses

_gc_log: list[tuple[int, float, float]] = []  # (generation, wall time, seconds)
_gc_t0: list[float] = [0.0]


def _gc_cb(phase: str, info: Mapping[str, int]) -> None:
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    elif len(_gc_log) < 100_000:
        _gc_log.append(
            (int(info.get("generation", -1)), time.time(), time.perf_counter() - _gc_t0[0])
        )


def gc_watch(state: WorkerState) -> None:
    """Start recording this process's garbage-collector pauses (they stop every thread)."""
    import gc

    _gc_log.clear()
    if _gc_cb not in gc.callbacks:
        gc.callbacks.append(_gc_cb)


def _generation(g: int) -> GcGeneration:
    d = [x for x in _gc_log if x[0] == g]
    return {
        "count": len(d),
        "total_s": sum(x[2] for x in d),
        "max_s": max((x[2] for x in d), default=0.0),
    }


def gc_report(state: WorkerState) -> GcReport:
    """Pauses per generation since ``gc_watch``: count, total and max seconds, slowest times."""
    import gc

    return {
        "tracked_objects": len(gc.get_objects()),
        "frozen_objects": gc.get_freeze_count(),
        "gen0": _generation(0),
        "gen1": _generation(1),
        "gen2": _generation(2),
        "slowest": [
            [round(t, 3), g, round(s, 4)] for g, t, s in sorted(_gc_log, key=lambda x: -x[2])[:10]
        ],
    }


COMMANDS: dict[str, Callable[..., object]] = {
    "stats": stats,
    "handshake_series": handshake_series,
    "cpu": cpu,
    "metadata_sizes": metadata_sizes,
    "gc_watch": gc_watch,
    "gc_report": gc_report,
}
