"""The passes scenarios drive from the orchestrator, on workers started by
``kvpush.bench.procs``: open-loop steady load (``steady_load``), a timed closed-loop pass
(``closed_loop``), a verified pass (``verified_pass``) and fresh raw NIXL nodes for a baseline
(``raw_pair``). Each sends worker commands (``kvpush.bench.loadgen``, ``kvpush.bench.raw_node``)
and returns their answers; the measuring happens inside the workers.

Runs on the scenario's thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvpush.bench.common import PREFILL_AHEAD_S
from kvpush.bench.procs import Worker


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
