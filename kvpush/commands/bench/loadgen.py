"""Load generators that run *inside* an endpoint process (a bench worker).

Each command takes the worker state and JSON-able keyword arguments and returns a JSON-able
result. P-side generators call the endpoint's ``prefill`` (fill + hand to the writer: what a
served PrefillReq does) or ``finish``; D-side generators call its ``decode`` and record what the
returned ``DecodeRep`` says: ``latency_s`` is D's own measure from the ``decode()`` call to the
verified completion (``kvpush.endpoint.load``: the endpoint's verbs).

Two shapes of load:

* **open loop** (``steady_*``): request ``i`` starts at wall time ``t0 + i / rate`` on both P and
  D (same host, same clock), whatever happened to earlier requests -- what an established peer
  sees while something else happens, without coordinated omission;
* **closed loop** (``*_many``): D keeps ``inflight`` requests outstanding; P prefills ahead as far
  as its pool allows. Used for throughput.

The endpoint itself is started here too (``start_endpoint``, through ``kvpush.endpoint``'s one
front door, ``open_endpoint``); what the scenarios read from it besides the generators' results
(telemetry, handshake timings, CPU, GC pauses) is ``kvpush.commands.bench.probes``.

Threads: the calling command thread, plus done-callbacks on D's completer thread.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from kvpush.commands.bench.probes import process_cpu_s, threads_cpu_s
from kvpush.commands.bench.worker_state import WorkerState

if TYPE_CHECKING:  # the engine is imported where an endpoint starts (start_endpoint)
    from concurrent.futures import Future

    from kvpush.endpoint import DecodeRep

#: Tokens of the requests a closed loop may still start (one taken per request, one given back
#: by each answer's callback).
Slots = queue.SimpleQueue[None]


class Recorded(TypedDict):
    """D's outcomes by request index (``decode_at``'s reply; the others extend it)."""

    t_call: list[float]  # seconds since the window's t0
    t_done: list[float | None]
    latency_s: list[float]  # D's own measure, decode() -> verified completion
    ok: list[bool]
    verified: list[bool | None]
    reasons: dict[str, int]  # failures by reason
    completed: int


class SteadyDecodeResult(Recorded):
    """The reply of ``steady_decode``."""

    max_late_s: float


class DecodeManyResult(Recorded):
    """The reply of ``decode_many``."""

    elapsed_s: float
    cpu_s: float
    threads_cpu_s: dict[str, float]


class SteadyPrefillResult(TypedDict):
    """The reply of ``steady_prefill``."""

    n: int
    max_late_s: float
    late_events: list[list[float]]  # [seconds since t0, seconds late] when > 20 ms late
    prefill_p50_s: float
    prefill_max_s: float


class EndpointInfo(TypedDict):
    """The reply of ``start_endpoint`` (``procs.Worker.info``)."""

    address: str
    engine_id: str
    incarnation: str
    pid: int
    role: str


def start_endpoint(state: WorkerState, config: dict[str, object]) -> EndpointInfo:
    """Start one endpoint from an ``EndpointConfig`` JSON map."""
    from kvpush.commands.common.node import build
    from kvpush.endpoint import freeze_startup_heap, open_endpoint

    cfg, instruments = build(config)
    ep = open_endpoint(cfg, instruments)
    state.endpoint.put(ep)
    freeze_startup_heap()  # as serve-* does: the figures are a served endpoint's
    return {
        "address": ep.address,
        "engine_id": cfg.engine_id,
        "incarnation": ep.incarnation,
        "pid": os.getpid(),
        "role": cfg.role,
    }


def _sleep_until(t_wall: float) -> None:
    while True:
        left = t_wall - time.time()
        if left <= 0:
            return
        time.sleep(min(left, 0.05) if left > 0.002 else left)


# --------------------------------------------------------------------------- recording


class _Recorder:
    """Issues D's decodes of ``n`` requests from one P and collects their ``DecodeRep``
    outcomes by request index (callbacks run on D's completer thread)."""

    def __init__(
        self, state: WorkerState, n: int, p_addr: str, blocks: int, deadline_s: float
    ) -> None:
        self._decode = state.endpoint.get().decode
        self._to = (p_addr, blocks, deadline_s)
        self.t_call = [0.0] * n
        self.t_done = [0.0] * n
        self.latency = [0.0] * n
        self.ok = [False] * n
        self.verified: list[bool | None] = [None] * n
        self.reasons: dict[str, int] = {}
        self._lock = threading.Lock()
        # One token per request answered. (A C queue, not a ``threading.Semaphore``: its
        # release is Python, ~2 us, paid on D's receiver thread -- this load generator's cost
        # was ~5 % of that thread's time, measured as kvpush's.)
        self.done: queue.SimpleQueue[None] = queue.SimpleQueue()

    def issue(self, i: int, transfer_id: str, slot: Slots | None = None) -> float:
        """Decode ``transfer_id`` as request ``i`` now (its done-callback gives ``slot`` back);
        the wall time of the call."""
        self.t_call[i] = now = time.time()
        self._decode(transfer_id, *self._to).add_done_callback(self.callback(i, slot))
        return now

    def callback(self, i: int, release: Slots | None = None) -> Callable[[Future[DecodeRep]], None]:
        def cb(f: Future[DecodeRep]) -> None:
            t = time.time()
            try:
                rep = f.result()
                self.t_done[i] = t
                self.latency[i] = rep.latency_s
                self.ok[i] = rep.outcome == "ok"
                self.verified[i] = rep.verified
                if rep.outcome != "ok":
                    with self._lock:
                        self.reasons[rep.reason] = self.reasons.get(rep.reason, 0) + 1
            except BaseException as e:  # a broken future is a result too
                with self._lock:
                    self.reasons[type(e).__name__] = self.reasons.get(type(e).__name__, 0) + 1
            finally:
                if release is not None:
                    release.put(None)
                self.done.put(None)

        return cb

    def wait(self, n: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        got = 0
        while got < n:
            try:
                self.done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            got += 1
        return got

    def result(self, t0: float, completed: int) -> Recorded:
        return {
            "t_call": [round(t - t0, 6) for t in self.t_call],
            "t_done": [round(t - t0, 6) if t else None for t in self.t_done],
            "latency_s": [round(x, 7) for x in self.latency],
            "ok": self.ok,
            "verified": self.verified,
            "reasons": self.reasons,
            "completed": completed,
        }


# --------------------------------------------------------------------------- D side


def steady_decode(
    state: WorkerState,
    p_addr: str,
    prefix: str,
    rate: float,
    t0: float,
    duration: float,
    blocks: int,
    deadline_s: float = 0.0,
    wait_s: float = 60.0,
) -> SteadyDecodeResult:
    """Open loop: decode ``{prefix}{i}`` at wall time ``t0 + i / rate`` for ``duration`` s."""
    n = max(1, int(duration * rate))
    rec = _Recorder(state, n, p_addr, blocks, deadline_s)
    late = 0.0
    for i in range(n):
        t = t0 + i / rate
        _sleep_until(t)
        late = max(late, rec.issue(i, f"{prefix}{i}") - t)
    completed = rec.wait(n, wait_s)
    return {**rec.result(t0, completed), "max_late_s": late}


def decode_at(
    state: WorkerState,
    p_addr: str,
    transfer_id: str,
    t_wall: float,
    blocks: int,
    deadline_s: float = 0.0,
    wait_s: float = 60.0,
) -> Recorded:
    """One decode at wall time ``t_wall`` (a peer joining)."""
    rec = _Recorder(state, 1, p_addr, blocks, deadline_s)
    _sleep_until(t_wall)
    rec.issue(0, transfer_id)
    completed = rec.wait(1, wait_s)
    return rec.result(t_wall, completed)


def decode_many(
    state: WorkerState,
    p_addr: str,
    prefix: str,
    n: int,
    blocks: int,
    inflight: int,
    deadline_s: float = 0.0,
    wait_s: float = 120.0,
) -> DecodeManyResult:
    """Closed loop: ``n`` decodes with at most ``inflight`` outstanding; returns timings + CPU."""
    rec = _Recorder(state, n, p_addr, blocks, deadline_s)
    slots: Slots = queue.SimpleQueue()  # a token per request that may be outstanding
    for _ in range(inflight):
        slots.put(None)
    cpu0 = process_cpu_s()
    th0 = threads_cpu_s(state)
    own0 = time.thread_time()  # this thread's: the load generator's, calling decode()
    t0 = time.time()
    for i in range(n):
        slots.get()
        rec.issue(i, f"{prefix}{i}", slots)
    issued = time.thread_time() - own0
    completed = rec.wait(n, wait_s)
    t1 = time.time()
    cpu_s = process_cpu_s() - cpu0
    th1 = threads_cpu_s(state)
    return {
        **rec.result(t0, completed),
        "elapsed_s": t1 - t0,
        "cpu_s": cpu_s,
        "threads_cpu_s": {k: th1[k] - th0.get(k, 0.0) for k in th1} | {"client": issued},
    }


def set_verify(state: WorkerState, verify: bool) -> None:
    """Turn D's content verification on or off (timed parts run without it, then verify)."""
    state.endpoint.get().set_verify(verify)


# --------------------------------------------------------------------------- P side


def steady_prefill(
    state: WorkerState, prefix: str, rate: float, t0: float, duration: float, blocks: int
) -> SteadyPrefillResult:
    """Open loop: prefill ``{prefix}{i}`` at wall time ``t0 + i / rate``."""
    ep = state.endpoint.get()
    n = max(1, int(duration * rate))
    late = 0.0
    events: list[list[float]] = []  # [seconds since t0, seconds late] when > 20 ms late
    took: list[float] = []
    for i in range(n):
        t = t0 + i / rate
        _sleep_until(t)
        now = time.time()
        late = max(late, now - t)
        if now - t > 0.02:
            events.append([round(t - t0, 4), round(now - t, 4)])
        ep.prefill(f"{prefix}{i}", blocks)
        took.append(time.time() - now)
    took.sort()
    return {
        "n": n,
        "max_late_s": late,
        "late_events": events[:1000],
        "prefill_p50_s": took[len(took) // 2],
        "prefill_max_s": took[-1],
    }


def prefill_at(state: WorkerState, transfer_id: str, t_wall: float, blocks: int) -> None:
    _sleep_until(t_wall)
    state.endpoint.get().prefill(transfer_id, blocks)


def prefill_many(
    state: WorkerState, prefix: str, n: int, blocks: int, start: int = 0
) -> dict[str, object]:
    """Prefill ``n`` transfers as fast as the pool allows (waits for free blocks, never fails)."""
    ep = state.endpoint.get()
    alloc = ep.pool.allocator
    waited = 0
    t0 = time.time()
    cpu0 = process_cpu_s()
    for i in range(start, start + n):
        while alloc.counts()["free"] < blocks:
            waited += 1
            time.sleep(0.0002)
        ep.prefill(f"{prefix}{i}", blocks)
    return {"elapsed_s": time.time() - t0, "waits": waited, "cpu_s": process_cpu_s() - cpu0}


def finish_many(
    state: WorkerState, prefix: str, n: int, blocks: int, start: int = 0
) -> dict[str, object]:
    """Mark ``n`` transfers' blocks finished *without* writing the pattern, as fast as the pool
    allows: the stand-in for a model that has just computed its KV, for timed parts whose D
    does not verify (content is checked in a separate, verified pass). Costs an allocation and
    an inbox put per rank, where ``prefill`` also writes every byte."""
    ep = state.endpoint.get()
    finish = ep.finish
    waited = 0
    t0 = time.time()
    i, end = start, start + n
    while i < end:
        # In batches, sleeping 1 ms when the pool is full: a tight retry loop would fight the
        # writer for the GIL and slow the very thing being measured.
        k = min(ep.free_blocks() // blocks, end - i)
        if k == 0:
            waited += 1
            time.sleep(0.001)
            continue
        for _ in range(k):
            finish(f"{prefix}{i}", blocks)
            i += 1
    return {"elapsed_s": time.time() - t0, "waits": waited}


def wait_idle(state: WorkerState, timeout_s: float = 30.0) -> dict[str, object]:
    """Wait until the pool has no allocated/in-flight blocks (all pushes done or failed)."""
    return dict(state.endpoint.get().wait_idle(timeout_s))


COMMANDS: dict[str, Callable[..., object]] = {
    "steady_decode": steady_decode,
    "decode_at": decode_at,
    "decode_many": decode_many,
    "set_verify": set_verify,
    "steady_prefill": steady_prefill,
    "prefill_at": prefill_at,
    "prefill_many": prefill_many,
    "finish_many": finish_many,
    "wait_idle": wait_idle,
}
