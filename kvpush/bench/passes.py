"""The passes scenarios drive from the orchestrator, on workers started by
``kvpush.bench.procs``: open-loop steady load (``steady_load``), a timed closed-loop pass
(``closed_loop``), a verified pass (``verified_pass``) and fresh raw NIXL nodes for a baseline
(``raw_pair``). Each sends worker commands (``kvpush.bench.loadgen``, ``kvpush.bench.raw_node``)
and returns their answers; the measuring happens inside the workers.

Runs on the scenario's thread.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvpush.bench.common import PREFILL_AHEAD_S, warmup_s
from kvpush.bench.procs import Worker
from kvpush.bench.stats import summary, window


@dataclass(frozen=True, kw_only=True)
class SteadyLoad:
    """D1's open-loop load and the pools it runs on, as ``hol`` and ``scale`` measure it (their
    parameters extend this one). The defaults are the full runs'; ``--quick`` lowers the rate
    and the pools."""

    rate: float = 200  # D1 requests per second (open loop)
    blocks: int = 1
    layers: int = 2
    block_bytes: int = 16384
    num_blocks: int = 2048


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


def join_request(
    pw: Worker, dw: Worker, transfer_id: str, t_wall: float, blocks: int, **decode: Any
) -> Future[Any]:
    """D sends one request to P at ``t_wall`` (a peer joining), P prefilling it
    ``PREFILL_AHEAD_S`` ahead (``decode``: more ``decode_at`` arguments). The future of D's
    ``decode_at`` answer."""
    f = dw.call_async(
        "decode_at",
        p_addr=pw.address,
        transfer_id=transfer_id,
        t_wall=t_wall,
        blocks=blocks,
        **decode,
    )
    pw.call_async(
        "prefill_at",
        transfer_id=transfer_id,
        t_wall=t_wall - PREFILL_AHEAD_S,
        blocks=blocks,
    )
    return f


def steady_phases(
    t: list[float], lat: list[float], ok: list[bool], before_s: float, during_s: float
) -> dict[str, dict[str, Any]]:
    """D1's latencies before, during and after a join (``t``: seconds since the join; the
    join's window lasts ``during_s``; the first seconds of the steady load are warm-up)."""
    phases = {}
    for ph, lo, hi in (
        ("before", -before_s + warmup_s(before_s), 0.0),
        ("during", 0.0, during_s),
        ("after", during_s, math.inf),
    ):
        vals, failed = window(t, lat, ok, lo, hi)
        phases[ph] = {**summary(vals), "failed": failed}
    return phases


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


def raw_pair(
    rt: Worker,
    ri: Worker,
    regions: int,
    target_blocks: int,
    initiator_blocks: int,
    block_bytes: int,
    **agent: Any,
) -> dict[str, Any]:
    """Fresh raw NIXL nodes for a baseline: the target polls (spins), the initiator does not
    (``agent``: more ``raw_node`` arguments for both). The target's info, to write to."""
    ti: dict[str, Any] = rt.call(
        "raw_node",
        regions=regions,
        num_blocks=target_blocks,
        block_bytes=block_bytes,
        **agent,
        poll="spin",
    )
    ri.call(
        "raw_node",
        regions=regions,
        num_blocks=initiator_blocks,
        block_bytes=block_bytes,
        **agent,
        poll="none",
    )
    return ti
