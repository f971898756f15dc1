"""The passes scenarios drive from the orchestrator, on workers started by
``kvpush.commands.bench.procs``: open-loop steady load (``steady_load``) and its latency phases
(``steady_phases``), a join request (``join_request``), a timed or verified closed-loop pass
(``ClosedLoop``) and fresh raw NIXL nodes for a baseline (``raw_pair``). Each sends worker
commands (``kvpush.commands.bench.loadgen``, ``kvpush.commands.bench.raw_node``) and returns their
answers; the measuring happens inside the workers.

Runs on the scenario's thread.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from kvpush.commands.bench.common import PREFILL_AHEAD_S, warmup_s
from kvpush.commands.bench.loadgen import (
    DecodeManyResult,
    Recorded,
    SteadyDecodeResult,
    SteadyPrefillResult,
)
from kvpush.commands.bench.procs import Worker
from kvpush.commands.bench.raw_node import RawNodeInfo
from kvpush.commands.bench.stats import summary, window

D = TypeVar("D")
P = TypeVar("P")


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
    pw: Worker, dw: Worker, load: SteadyLoad, prefix: str, t0: float, duration: float, wait_s: float
) -> tuple[Future[SteadyDecodeResult], Future[SteadyPrefillResult]]:
    """Open-loop load from ``t0`` for ``duration`` s: D decodes ``{prefix}{i}`` at ``load.rate``
    per second while P finishes the same transfers ahead. The futures of D's ``steady_decode``
    and P's ``steady_prefill`` answers."""
    args: dict[str, float | str] = {
        "prefix": prefix,
        "rate": load.rate,
        "t0": t0,
        "duration": duration,
        "blocks": load.blocks,
    }
    cmds = ("steady_decode", "steady_prefill")
    replies = (SteadyDecodeResult, SteadyPrefillResult)
    return _p_ahead(pw, dw, cmds, replies, "t0", args, wait_s=wait_s)


def join_request(
    pw: Worker, dw: Worker, transfer_id: str, t_wall: float, blocks: int, **decode: float
) -> Future[Recorded]:
    """D sends one request to P at ``t_wall`` (a peer joining), P prefilling it ahead
    (``decode``: more ``decode_at`` arguments). The future of D's ``decode_at`` answer."""
    args: dict[str, float | str] = {"transfer_id": transfer_id, "t_wall": t_wall, "blocks": blocks}
    cmds = ("decode_at", "prefill_at")
    return _p_ahead(pw, dw, cmds, (Recorded, object), "t_wall", args, **decode)[0]


def _p_ahead(
    pw: Worker,
    dw: Worker,
    cmds: tuple[str, str],
    replies: tuple[type[D], type[P]],
    at: str,
    args: dict[str, float | str],
    **decode: float,
) -> tuple[Future[D], Future[P]]:
    """D's command of ``cmds`` (D's, P's) with ``args``, and P's with the same ``args`` but its
    start time (argument ``at``) ``PREFILL_AHEAD_S`` earlier, so that D's latency measures the
    push, not P catching up. The futures of D's and P's answers."""
    d_cmd, p_cmd = cmds
    d_reply, p_reply = replies
    fd = dw.call_async(d_cmd, reply=d_reply, p_addr=pw.address, **args, **decode)
    start = args[at]
    assert isinstance(start, float)  # t0 or t_wall: a wall-clock time
    fp = pw.call_async(p_cmd, reply=p_reply, **{**args, at: start - PREFILL_AHEAD_S})
    return fd, fp


def steady_phases(
    t: list[float], lat: list[float], ok: list[bool], before_s: float, during_s: float
) -> dict[str, dict[str, float]]:
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


@dataclass(frozen=True)
class ClosedLoop:
    """A closed-loop pass: D decodes ``{prefix}0`` .. ``{prefix}{n - 1}`` from P, ``blocks``
    blocks each, ``inflight`` outstanding. ``timed`` and ``verified`` run it."""

    pw: Worker
    dw: Worker
    prefix: str
    n: int
    blocks: int
    inflight: int

    def timed(
        self, finish_wait_s: float = 60.0, **decode: float
    ) -> tuple[DecodeManyResult, dict[str, float], dict[str, float]]:
        """P finishes the transfers (no bytes written) as fast as its pool allows while D
        decodes them (``decode``: more ``decode_many`` arguments). Returns D's ``decode_many``
        answer and P's thread CPU seconds before and after it."""
        pw = self.pw
        fp = pw.call_async("finish_many", prefix=self.prefix, n=self.n, blocks=self.blocks)
        c0 = pw.call("cpu", reply=dict[str, float])
        r = self._decode_many({"call_timeout": 900, **decode})
        c1 = pw.call("cpu", reply=dict[str, float])
        fp.result(finish_wait_s)
        return r, c0, c1

    def verified(self, prefill_wait_s: float = 60.0, **decode: float) -> DecodeManyResult:
        """P writes the pattern into the transfers and D, its verification switched on, checks
        every byte (``decode``: more ``decode_many`` arguments). D's ``decode_many`` answer."""
        self.dw.call("set_verify", verify=True)
        fv = self.pw.call_async("prefill_many", prefix=self.prefix, n=self.n, blocks=self.blocks)
        v = self._decode_many(decode)
        fv.result(prefill_wait_s)
        return v

    def _decode_many(self, more: dict[str, float]) -> DecodeManyResult:
        return self.dw.call(
            "decode_many",
            reply=DecodeManyResult,
            p_addr=self.pw.address,
            prefix=self.prefix,
            n=self.n,
            blocks=self.blocks,
            inflight=self.inflight,
            **more,
        )


def raw_pair(
    rt: Worker,
    ri: Worker,
    regions: int,
    target_blocks: int,
    initiator_blocks: int,
    block_bytes: int,
    **agent: bool,
) -> RawNodeInfo:
    """Fresh raw NIXL nodes for a baseline: the target polls (spins), the initiator does not
    (``agent``: more ``raw_node`` arguments for both). The target's info, to write to."""
    shape = {"regions": regions, "block_bytes": block_bytes, **agent}  # the same on both
    ti = rt.call("raw_node", reply=RawNodeInfo, num_blocks=target_blocks, poll="spin", **shape)
    ri.call("raw_node", num_blocks=initiator_blocks, poll="none", **shape)
    return ti
