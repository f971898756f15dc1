"""Load generators and probes that run *inside* an endpoint process (a bench worker).

Each command takes the worker state and JSON-able keyword arguments and returns a JSON-able
result. P-side generators call ``PrefillEndpoint.prefill`` (fill + hand to the writer); D-side
generators call ``DecodeEndpoint.decode`` and record what the returned ``DecodeRep`` says:
``latency_s`` is D's own measure from the ``decode()`` call to the verified completion.

Two shapes of load:

* **open loop** (``steady_*``): request ``i`` starts at wall time ``t0 + i / rate`` on both P and
  D (same host, same clock), whatever happened to earlier requests -- what an established peer
  sees while something else happens, without coordinated omission;
* **closed loop** (``*_many``): D keeps ``inflight`` requests outstanding; P prefills ahead as far
  as its pool allows. Used for throughput.

Threads: the calling command thread, plus done-callbacks on D's completer thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvpush.config import HandshakeMode, parse_address

_SC_CLK_TCK = os.sysconf("SC_CLK_TCK")


def start_endpoint(state: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Start one endpoint from an ``EndpointConfig`` JSON map."""
    from kvpush.ops.engine import open_endpoint
    from kvpush.ops.node import build_config

    cfg = build_config(config)
    ep = open_endpoint(cfg)
    state.endpoint = ep
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
    """Collects DecodeRep outcomes by request index (callbacks run on D's completer thread)."""

    def __init__(self, n: int) -> None:
        self.t_call = [0.0] * n
        self.t_done = [0.0] * n
        self.latency = [0.0] * n
        self.ok = [False] * n
        self.verified: list[bool | None] = [None] * n
        self.reasons: dict[str, int] = {}
        self._lock = threading.Lock()
        self.done = threading.Semaphore(0)

    def callback(self, i: int, release: threading.Semaphore | None = None) -> Any:
        def cb(f: Future[Any]) -> None:
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
                    release.release()
                self.done.release()

        return cb

    def wait(self, n: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        got = 0
        while got < n:
            if not self.done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
            got += 1
        return got

    def result(self, t0: float, completed: int) -> dict[str, Any]:
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
    state: Any,
    p_addr: str,
    prefix: str,
    rate: float,
    t0: float,
    duration: float,
    blocks: int,
    deadline_s: float = 0.0,
    wait_s: float = 60.0,
) -> dict[str, Any]:
    """Open loop: decode ``{prefix}{i}`` at wall time ``t0 + i / rate`` for ``duration`` s."""
    ep = state.endpoint
    n = max(1, int(duration * rate))
    rec = _Recorder(n)
    late = 0.0
    for i in range(n):
        t = t0 + i / rate
        _sleep_until(t)
        rec.t_call[i] = now = time.time()
        late = max(late, now - t)
        fut = ep.role.decode(f"{prefix}{i}", p_addr, blocks, deadline_s)
        fut.add_done_callback(rec.callback(i))
    completed = rec.wait(n, wait_s)
    out = rec.result(t0, completed)
    out["max_late_s"] = late
    return out


def decode_at(
    state: Any,
    p_addr: str,
    transfer_id: str,
    t_wall: float,
    blocks: int,
    deadline_s: float = 0.0,
    wait_s: float = 60.0,
) -> dict[str, Any]:
    """One decode at wall time ``t_wall`` (a peer joining)."""
    ep = state.endpoint
    rec = _Recorder(1)
    _sleep_until(t_wall)
    rec.t_call[0] = time.time()
    ep.role.decode(transfer_id, p_addr, blocks, deadline_s).add_done_callback(rec.callback(0))
    completed = rec.wait(1, wait_s)
    return rec.result(t_wall, completed)


def decode_many(
    state: Any,
    p_addr: str,
    prefix: str,
    n: int,
    blocks: int,
    inflight: int,
    deadline_s: float = 0.0,
    wait_s: float = 120.0,
) -> dict[str, Any]:
    """Closed loop: ``n`` decodes with at most ``inflight`` outstanding; returns timings + CPU."""
    ep = state.endpoint
    rec = _Recorder(n)
    slots = threading.Semaphore(inflight)
    cpu0 = process_cpu_s()
    th0 = threads_cpu_s(state)
    t0 = time.time()
    for i in range(n):
        slots.acquire()
        rec.t_call[i] = time.time()
        ep.role.decode(f"{prefix}{i}", p_addr, blocks, deadline_s).add_done_callback(
            rec.callback(i, slots)
        )
    completed = rec.wait(n, wait_s)
    t1 = time.time()
    out = rec.result(t0, completed)
    out["elapsed_s"] = t1 - t0
    out["cpu_s"] = process_cpu_s() - cpu0
    th1 = threads_cpu_s(state)
    out["threads_cpu_s"] = {k: th1[k] - th0.get(k, 0.0) for k in th1}
    return out


def set_verify(state: Any, verify: bool) -> None:
    """Turn D's content verification on or off (timed parts run without it, then verify)."""
    state.endpoint.group.set_verify(verify)


# --------------------------------------------------------------------------- P side


def steady_prefill(
    state: Any, prefix: str, rate: float, t0: float, duration: float, blocks: int
) -> dict[str, Any]:
    """Open loop: prefill ``{prefix}{i}`` at wall time ``t0 + i / rate``."""
    ep = state.endpoint
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
        ep.role.prefill(f"{prefix}{i}", blocks)
        took.append(time.time() - now)
    took.sort()
    return {
        "n": n,
        "max_late_s": late,
        "late_events": events[:1000],
        "prefill_p50_s": took[len(took) // 2],
        "prefill_max_s": took[-1],
    }


def prefill_at(state: Any, transfer_id: str, t_wall: float, blocks: int) -> None:
    _sleep_until(t_wall)
    state.endpoint.role.prefill(transfer_id, blocks)


def prefill_many(state: Any, prefix: str, n: int, blocks: int, start: int = 0) -> dict[str, Any]:
    """Prefill ``n`` transfers as fast as the pool allows (waits for free blocks, never fails)."""
    ep = state.endpoint
    alloc = ep.pool.allocator
    waited = 0
    t0 = time.time()
    cpu0 = process_cpu_s()
    for i in range(start, start + n):
        while alloc.counts()["free"] < blocks:
            waited += 1
            time.sleep(0.0002)
        ep.role.prefill(f"{prefix}{i}", blocks)
    return {"elapsed_s": time.time() - t0, "waits": waited, "cpu_s": process_cpu_s() - cpu0}


def finish_many(state: Any, prefix: str, n: int, blocks: int, start: int = 0) -> dict[str, Any]:
    """Mark ``n`` transfers' blocks finished *without* writing the pattern, as fast as the pool
    allows: the stand-in for a model that has just computed its KV, for timed parts whose D
    does not verify (content is checked in a separate, verified pass). Costs an allocation and
    an inbox put per rank, where ``prefill`` also writes every byte."""
    from kvpush.prefill.table import Finished

    ep = state.endpoint
    roles = ep.roles
    allocs = [r.ctx.pool.allocator for r in roles]
    waited = 0
    t0 = time.time()
    i, end = start, start + n
    while i < end:
        # In batches, sleeping 1 ms when the pool is full: a tight retry loop would fight the
        # writer for the GIL and slow the very thing being measured.
        k = min(min(a.counts()["free"] for a in allocs) // blocks, end - i)
        if k == 0:
            waited += 1
            time.sleep(0.001)
            continue
        for _ in range(k):
            tid = f"{prefix}{i}"
            for role, alloc in zip(roles, allocs, strict=True):
                ids = alloc.allocate(tid, blocks)
                role.writer.finished.put(Finished(tid, tid, tid, ids, time.monotonic()))
            i += 1
    return {"elapsed_s": time.time() - t0, "waits": waited}


def wait_idle(state: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until the pool has no allocated/in-flight blocks (all pushes done or failed)."""
    ep = state.endpoint
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [r.ctx.pool.allocator.counts() for r in ep.roles]
        c: dict[str, Any] = {k: sum(x[k] for x in counts) for k in counts[0]}
        if c["free"] + c["quarantined"] == c["total"] or time.monotonic() > deadline:
            return c
        time.sleep(0.01)


# --------------------------------------------------------------------------- probes


def stats(state: Any) -> dict[str, Any]:
    snap: dict[str, Any] = state.endpoint.snapshot().to_dict()
    return snap


def handshake_series(
    state: Any, p_addr: str, modes: list[str], repeats: int, settle_s: float = 0.0
) -> dict[str, Any]:
    """Handshake to ``p_addr`` ``repeats`` times per mode (interleaved), forgetting the peer
    after each so the next one starts from nothing. Returns phase timings per mode."""
    ep = state.endpoint
    key = (*parse_address(p_addr), 0)  # the handshake manager's key: P's rank 0
    out: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            t0 = time.perf_counter()
            conn = ep.handshake_to(p_addr, HandshakeMode(m))
            wall = time.perf_counter() - t0
            row = dict(conn.timings)
            row["call_s"] = wall
            out[m].append(row)
            old = ep.handshakes.evict(key, "bench: next round")
            if old is not None:
                ep.handshakes.release_conn(old)
            if settle_s:
                time.sleep(settle_s)
    return out


def metadata_sizes(state: Any) -> dict[str, int]:
    """Bytes this endpoint sends in a handshake reply: its NIXL agent metadata in each mode
    and kvpush's own endpoint metadata."""
    ep = state.endpoint
    return {
        "agent_full": len(ep.ranks[0].agent_md_full),
        "agent_conn_only": len(ep.ranks[0].agent_md_conn),
        "endpoint": len(ep.ranks[0].md_bytes),
    }


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


def threads_cpu_s(state: Any) -> dict[str, float]:
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


def cpu(state: Any) -> dict[str, float]:
    return threads_cpu_s(state)


# --------------------------------------------------------------------------- GC pauses

_gc_log: list[tuple[int, float, float]] = []  # (generation, wall time, seconds)
_gc_t0: list[float] = [0.0]


def _gc_cb(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    elif len(_gc_log) < 100_000:
        _gc_log.append(
            (int(info.get("generation", -1)), time.time(), time.perf_counter() - _gc_t0[0])
        )


def gc_watch(state: Any) -> None:
    """Start recording this process's garbage-collector pauses (they stop every thread)."""
    import gc

    _gc_log.clear()
    if _gc_cb not in gc.callbacks:
        gc.callbacks.append(_gc_cb)


def gc_report(state: Any) -> dict[str, Any]:
    """Pauses per generation since ``gc_watch``: count, total and max seconds, slowest times."""
    import gc

    out: dict[str, Any] = {"tracked_objects": len(gc.get_objects())}
    for g in (0, 1, 2):
        d = [x for x in _gc_log if x[0] == g]
        out[f"gen{g}"] = {
            "count": len(d),
            "total_s": sum(x[2] for x in d),
            "max_s": max((x[2] for x in d), default=0.0),
        }
    out["slowest"] = [
        [round(t, 3), g, round(s, 4)] for g, t, s in sorted(_gc_log, key=lambda x: -x[2])[:10]
    ]
    return out


COMMANDS: dict[str, Callable[..., Any]] = {
    "steady_decode": steady_decode,
    "decode_at": decode_at,
    "decode_many": decode_many,
    "set_verify": set_verify,
    "steady_prefill": steady_prefill,
    "prefill_at": prefill_at,
    "prefill_many": prefill_many,
    "finish_many": finish_many,
    "wait_idle": wait_idle,
    "stats": stats,
    "handshake_series": handshake_series,
    "cpu": cpu,
    "metadata_sizes": metadata_sizes,
    "gc_watch": gc_watch,
    "gc_report": gc_report,
}
