"""Shared pieces of the scenarios: endpoint configs, the progress callback type, time bases."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpush.bench.procs import Worker

Progress = Callable[[str], None]

#: Lead time between scheduling an open-loop window and its start, so that every worker has
#: received its command before the first request is due.
LEAD_S = 0.4


#: P's open-loop generators finish a transfer's blocks this long before D asks for it, so that
#: D's latency measures the push (PUSH_REG -> WRITE -> completion), not P's model-stand-in
#: catching up after a scheduling hiccup.
PREFILL_AHEAD_S = 0.1


#: The first part of every open-loop window is not counted: both generators start at once and
#: their first requests meet cold paths of the bench itself (thread start, first fill).
def warmup_s(before_s: float) -> float:
    return min(0.25, before_s / 4)


def endpoint_cfg(
    role: str,
    *,
    layers: int,
    block_bytes: int,
    num_blocks: int,
    verify: bool = True,
    writer: str = "deferred",
    progress_thread: bool = False,
    timeouts: dict[str, float] | None = None,
    reply_delay_s: float = 0.0,
) -> dict[str, Any]:
    """An ``EndpointConfig`` and its ``Instruments`` as the JSON map ``kvpush.ops.node.build``
    reads."""
    cfg: dict[str, Any] = {
        "role": role,
        "pool": {"num_blocks": num_blocks, "layers": layers, "block_bytes": block_bytes},
        "agent": {"progress_thread": progress_thread},
        "verify": verify,
        "writer_mode": writer,
    }
    if os.environ.get("KVPUSH_BENCH_PHASE_STAMPS") == "0":
        # What the per-request phase stamps cost (BENCHMARKS.md): every endpoint without them.
        cfg["phase_stamps"] = False
    if timeouts:
        cfg["timeouts"] = timeouts
    if reply_delay_s:
        cfg["handshake_reply_delay_s"] = reply_delay_s
    return cfg


def start_at(lead_s: float = LEAD_S) -> float:
    """A wall-clock start time shared by the workers (same host, same clock)."""
    return time.time() + lead_s


def logs_dir(out_dir: Path, scenario: str) -> Path:
    d = out_dir / "logs" / f"{scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def steady_load(
    pw: Worker,
    dw: Worker,
    prefix: str,
    rate: float,
    t0: float,
    duration: float,
    blocks: int,
    wait_s: float,
) -> tuple[Future[Any], Future[Any]]:
    """Open-loop load from ``t0`` for ``duration`` s: D decodes ``{prefix}{i}`` at ``rate``
    per second while P finishes the same transfers ``PREFILL_AHEAD_S`` ahead. The futures of
    D's ``steady_decode`` and P's ``steady_prefill`` answers."""
    fd = dw.call_async(
        "steady_decode",
        p_addr=pw.address,
        prefix=prefix,
        rate=rate,
        t0=t0,
        duration=duration,
        blocks=blocks,
        wait_s=wait_s,
    )
    fp = pw.call_async(
        "steady_prefill",
        prefix=prefix,
        rate=rate,
        t0=t0 - PREFILL_AHEAD_S,
        duration=duration,
        blocks=blocks,
    )
    return fd, fp


def closed_loop(
    pw: Worker,
    dw: Worker,
    prefix: str,
    n: int,
    blocks: int,
    inflight: int,
    finish_wait_s: float = 60.0,
    **decode: Any,
) -> tuple[dict[str, Any], dict[str, float], dict[str, float]]:
    """A timed closed-loop pass: P finishes ``n`` transfers (no bytes written) as fast as its
    pool allows while D decodes them with ``inflight`` outstanding (``decode``: more
    ``decode_many`` arguments). Returns D's ``decode_many`` answer and P's thread CPU seconds
    before and after it."""
    fp = pw.call_async("finish_many", prefix=prefix, n=n, blocks=blocks)
    c0: dict[str, float] = pw.call("cpu")
    r = _decode_many(pw, dw, prefix, n, blocks, inflight, {"call_timeout": 900, **decode})
    c1: dict[str, float] = pw.call("cpu")
    fp.result(finish_wait_s)
    return r, c0, c1


def verified_pass(
    pw: Worker,
    dw: Worker,
    prefix: str,
    n: int,
    blocks: int,
    inflight: int,
    prefill_wait_s: float = 60.0,
    **decode: Any,
) -> dict[str, Any]:
    """P writes the pattern into ``n`` transfers and D, its verification switched on, checks
    every byte (``decode``: more ``decode_many`` arguments). D's ``decode_many`` answer."""
    dw.call("set_verify", verify=True)
    fv = pw.call_async("prefill_many", prefix=prefix, n=n, blocks=blocks)
    v = _decode_many(pw, dw, prefix, n, blocks, inflight, decode)
    fv.result(prefill_wait_s)
    return v


def _decode_many(
    pw: Worker, dw: Worker, prefix: str, n: int, blocks: int, inflight: int, more: dict[str, Any]
) -> dict[str, Any]:
    r: dict[str, Any] = dw.call(
        "decode_many",
        p_addr=pw.address,
        prefix=prefix,
        n=n,
        blocks=blocks,
        inflight=inflight,
        **more,
    )
    return r
