"""Scenario ``model``: pushes at real model geometry, with block ids as real pools leave them.

Per shape (``kvpush.memory.shapes``: ``llama-8b``, ``llama-70b-tp8``, ``mla``) one P and one D
endpoint process, with pools of that shape; per request size (512, 2k, 8k tokens) and per id
pattern, in the same rounds:

* **kvpush** end to end: D keeps ``inflight`` requests outstanding (``decode_many``), P marks
  blocks finished as fast as its pool allows (``finish_many``); D's verification off in the
  timed part, then a verified pass (P writes the pattern, D checks every byte);
* **raw NIXL**, merge on and merge off (``skip_desc_merge``): a second agent in each endpoint
  process registering the same pool memory, replaying the exact (P ids, D ids) pairs kvpush's
  previous pass used (``raw.raw_pairs_loop``), its target polling like kvpush's D receiver;
* **process_vm_writev** of the same bytes: one iovec per merged run per region.

Id patterns: ``contiguous`` (fresh pools, kvpush's extent allocator), ``shuffled`` (the plain
free list in a seeded random order: the worst case), ``churn`` (the extent allocator after a
seeded churn of mixed request sizes and lifetimes, ``kvpush.commands.bench.churn``) and
``churn-freelist`` (the same churn on the plain free list kvpush used before). Both P and D
pools churn (different seeds). Descriptors per WRITE are counted from the ids each request
really got (``memory.descriptors.merged_descriptors``); CPU per request from the P writer
thread, the P process and the D process.

Plus, in the orchestrator, the cost of ``allocate``/``release`` from 1- to 64k-block pools.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.commands.bench.churn import alloc_cost
from kvpush.commands.bench.common import EndpointCfg, Progress, endpoint_cfg, logs_dir
from kvpush.commands.bench.host_limits import CopyResult
from kvpush.commands.bench.model_cells import (
    AllocCost,
    Cell,
    CellBase,
    FreshPool,
    KvPass,
    Rounds,
    RunLens,
)
from kvpush.commands.bench.model_plan import Plan
from kvpush.commands.bench.model_report import COST_SERIES, PATTERNS, report
from kvpush.commands.bench.modelgen import ChurnInfo, FragInfo
from kvpush.commands.bench.passes import ClosedLoop
from kvpush.commands.bench.procs import Cluster, Worker
from kvpush.commands.bench.raw import RawLoopResult
from kvpush.commands.bench.raw_node import RawNodeInfo
from kvpush.commands.bench.report import Report, ResultDict
from kvpush.commands.bench.stats import median
from kvpush.config import KvRegions, Role
from kvpush.memory.allocator import BlockAllocator, FreeListAllocator
from kvpush.memory.descriptors import merged_descriptors
from kvpush.memory.shapes import Shape

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

#: pattern -> (allocator, shuffled order, churn first)
_PATTERN = {
    "contiguous": ("extent", False, False),
    "shuffled": ("freelist", True, False),
    "churn": ("extent", False, True),
    "churn-freelist": ("freelist", False, True),
}
COST_POOLS_FULL = (1, 16, 256, 4096, 65536)
COST_POOLS_QUICK = (1, 256, 4096)
SEED_P, SEED_D = 11, 22


def inflight_for(request_bytes: int) -> int:
    """Requests D keeps outstanding: at least 2, so that the next WRITE is always posted while
    one completes (with 1, every request would also time D's completion -> next PUSH_REG round
    trip, which raw NIXL's back-to-back loop never waits for); 4 for requests up to 64 MiB."""
    return 4 if request_bytes <= 64 << 20 else 2


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    plan = Plan.make(quick)
    rep = Report(
        "model",
        "model: pushes at real model geometry, ids contiguous, shuffled and after churn",
        quick,
        params={
            "shapes": [
                {**asdict(s), "page_bytes": s.page_bytes, "pool_blocks": plan.pool_blocks[s.name]}
                for s in plan.shapes
            ],
            "tokens": list(plan.tokens),
            "patterns": list(PATTERNS),
            "bytes_per_measurement": plan.budget,
            "rounds": plan.rounds,
            "churn": asdict(plan.churn),
            "seeds": {"p": SEED_P, "d": SEED_D},
        },
    )
    progress("model: allocation cost by pool size")
    cost = _alloc_costs(quick)
    cells: list[Cell] = []
    with Cluster(logs_dir(out_dir, "model")) as cl:
        # Full run: one shape's processes at a time (GiBs of pools each, and no neighbours
        # while measuring). Quick: all start together, a smoke has nothing to disturb.
        started: dict[str, Worker] | None = None
        if quick:
            started = cl.endpoints(
                {k: v for s in plan.shapes for k, v in _specs(s, plan).items()}, timeout_s=180.0
            )
        for shape in plan.shapes:
            cells.extend(_shape(cl, shape, plan, progress, started))
    report(rep, plan, cells, cost, out_dir)
    return rep.to_dict()


# --------------------------------------------------------------------------- allocation cost


def _alloc_costs(quick: bool) -> list[AllocCost]:
    pools = COST_POOLS_QUICK if quick else COST_POOLS_FULL
    ops = 500 if quick else 20000
    rounds = 1 if quick else 3
    out: list[AllocCost] = []
    for series, sizes in COST_SERIES.items():
        for name, cls in (("extent", BlockAllocator), ("freelist", FreeListAllocator)):
            for n in pools:
                rs = [alloc_cost(cls, n, sizes, ops, seed=3 + k) for k in range(rounds)]
                out.append(
                    {
                        "series": series,
                        "allocator": name,
                        "num_blocks": n,
                        "allocate_ns": median([r["allocate_ns"] for r in rs]),
                        "release_ns": median([r["release_ns"] for r in rs]),
                        "max_free_runs": max(r["max_free_runs"] for r in rs),
                        "rounds": rs,
                    }
                )
    return out


# --------------------------------------------------------------------------- one shape


def _endpoint(role: Role, shape: Shape, num_blocks: int) -> EndpointCfg:
    cfg = endpoint_cfg(
        role,
        layers=shape.layers,
        block_bytes=shape.page_bytes,
        num_blocks=num_blocks,
        verify=False,
    )
    cfg["pool"]["dtype"] = shape.dtype
    if shape.regions_per_layer == 1:
        cfg["pool"]["kv_regions"] = KvRegions.PER_LAYER.value  # one region per layer (MLA)
    return cfg


def _specs(shape: Shape, plan: Plan) -> dict[str, EndpointCfg]:
    nb = plan.pool_blocks[shape.name]
    tag = shape.name.replace("/", "-")
    return {
        f"p-{tag}": _endpoint(Role.PREFILL, shape, nb),
        f"d-{tag}": _endpoint(Role.DECODE, shape, nb),
    }


def _shape(
    cl: Cluster,
    shape: Shape,
    plan: Plan,
    progress: Progress,
    started: dict[str, Worker] | None = None,
) -> list[Cell]:
    """Every (size, pattern) cell of one shape, on one P/D pair (started here, or ``started``
    already), stopped at the end."""
    nb = plan.pool_blocks[shape.name]
    progress(f"model: {shape.describe()}, pools of {nb} blocks")
    specs = _specs(shape, plan)
    ws = started if started is not None else cl.endpoints(specs, timeout_s=180.0)
    pw, dw = (ws[name] for name in specs)
    # The raw target polls like kvpush's D receiver (spin 2 ms after activity, then sleep up
    # to 1 ms): at these sizes polling back to back was no faster and takes a core.
    target = dw.call(
        "raw_pool_node", reply=RawNodeInfo, poll="backoff", paused=True, call_timeout=300
    )
    pw.call("raw_pool_node", poll="none", paused=True, call_timeout=300)
    pw.call("raw_prepare", target=target, call_timeout=300)
    # Warm the P->D path once (handshake, UCX wire-up) before anything is timed.
    _setup(pw, dw, shape, "contiguous", nb, plan)
    t0 = plan.tokens[0]
    _kvpush(pw, dw, f"{shape.name}.warm.", 8, shape, shape.blocks_for(t0), 4)
    cells: list[Cell] = []
    for tokens in plan.tokens:
        cells.extend(_size(pw, dw, target, shape, nb, tokens, plan, progress))
    for w in (pw, dw):
        w.call("raw_close")
    for w in (pw, dw):  # both stop (and drain) at once
        w.call_async("stop")
    for w in (pw, dw):
        cl.stop(w)
    return cells


def _setup(
    pw: Worker, dw: Worker, shape: Shape, pattern: str, need: int, plan: Plan
) -> dict[str, ChurnInfo | FreshPool]:
    """Fresh allocators of the pattern's policy on P and D, churned if the pattern says so
    (seeded: the same pools every time). Returns what each side's pool looks like."""
    kind, shuffled, do_churn = _PATTERN[pattern]
    out: dict[str, ChurnInfo | FreshPool] = {}
    for side, w, seed in (("p", pw, SEED_P), ("d", dw, SEED_D)):
        w.call("model_pool", kind=kind, order_seed=seed if shuffled else None, call_timeout=60)
        if do_churn:
            spec = {**asdict(plan.churn), "seed": plan.churn.seed + seed}
            out[side] = w.call(
                "model_churn",
                reply=ChurnInfo,
                spec=spec,
                block_tokens=shape.block_tokens,
                need_blocks=need,
                call_timeout=300,
            )
        else:
            out[side] = {"fragmentation": w.call("model_frag", reply=FragInfo)}
    return out


def _size(
    pw: Worker,
    dw: Worker,
    target: RawNodeInfo,
    shape: Shape,
    nb: int,
    tokens: int,
    plan: Plan,
    progress: Progress,
) -> list[Cell]:
    """One request size, every pattern. Each round measures all four patterns back to back
    (in a rotating order), each as: pools set up, a kvpush pass, then raw NIXL (merge on,
    merge off) and process_vm_writev replaying the ids that pass got -- so that every ratio
    is taken between measurements seconds apart, round by round."""
    blocks = shape.blocks_for(tokens)
    req_bytes = shape.request_bytes(tokens)
    inflight = inflight_for(req_bytes)
    n = max(3 * inflight, math.ceil(plan.budget / req_bytes))
    need = min(nb, inflight * blocks)  # what the in-flight requests hold, on either side
    acc: dict[str, Rounds] = {
        p: {"kv": [], "raw_on": [], "raw_off": [], "pvw": [], "raw_cpu": []} for p in PATTERNS
    }
    pools: dict[str, dict[str, ChurnInfo | FreshPool]] = {}
    for k in range(plan.rounds):
        progress(f"model: {shape.name}, {tokens} tokens, round {k + 1}/{plan.rounds}")
        order = PATTERNS[k % len(PATTERNS) :] + PATTERNS[: k % len(PATTERNS)]
        for pattern in order:
            a = acc[pattern]
            pools[pattern] = _setup(pw, dw, shape, pattern, need, plan)
            r = _kvpush(
                pw, dw, f"{shape.name}.{tokens}.{pattern}.r{k}.", n, shape, blocks, inflight
            )
            a["kv"].append(r)
            _replay(pw, dw, target, r["pairs"], n, inflight, a)
    cells: list[Cell] = []
    for pattern in PATTERNS:
        _setup(pw, dw, shape, pattern, need, plan)
        verified, nv = _verified_pass(
            pw, dw, f"{shape.name}.{tokens}.{pattern}.v.", inflight, blocks
        )
        cells.append(
            {
                **_cell(shape, tokens, pattern, blocks, req_bytes, inflight, n, acc[pattern]),
                "verified": verified,
                "verify_requests": nv,
                "pool": pools[pattern],
                **_run_lens(acc[pattern]),
            }
        )
    return cells


def _replay(
    pw: Worker,
    dw: Worker,
    target: RawNodeInfo,
    pairs: list[list[list[int]]],
    n: int,
    inflight: int,
    a: Rounds,
) -> None:
    """Replay the ids a kvpush pass got with raw NIXL (merge on, then off) and
    process_vm_writev; the figures go into ``a``."""
    dw.call("raw_poll", on=True)
    try:
        r_on, r_off = (
            pw.call(
                "raw_pairs_loop",
                reply=RawLoopResult,
                pairs=pairs,
                n=n,
                inflight=inflight,
                merge=merge,
                call_timeout=900,
            )
            for merge in (True, False)
        )
    finally:
        dw.call("raw_poll", on=False)
    a["raw_on"].append(r_on["gbps"])
    a["raw_cpu"].append(r_on["thread_cpu_s"] / r_on["n"])
    a["raw_off"].append(r_off["gbps"])
    pvw = pw.call("pvw_pairs", reply=CopyResult, target=target, pairs=pairs, n=n, call_timeout=900)
    a["pvw"].append(pvw["gbps"])


def _cell(
    shape: Shape,
    tokens: int,
    pattern: str,
    blocks: int,
    req_bytes: int,
    inflight: int,
    n: int,
    a: Rounds,
) -> CellBase:
    """One (size, pattern) cell of the result from its rounds' figures ``a``."""
    kv = a["kv"]
    return {
        "shape": shape.name,
        "tokens": tokens,
        "pattern": pattern,
        "blocks": blocks,
        "regions": shape.regions,
        "request_bytes": req_bytes,
        "inflight": inflight,
        "requests": n,
        "descs_unmerged": blocks * shape.regions,
        "descs_per_write": median([r["descs_mean"] for r in kv]),
        "descs_max": max(r["descs_max"] for r in kv),
        "kvpush_gbps": [r["gbps"] for r in kv],
        "kvpush_per_s": [r["per_s"] for r in kv],
        "kvpush_failed": sum(r["failed"] for r in kv),
        "writer_cpu_per_req_s": [r["writer_cpu_per_req_s"] for r in kv],
        "p_cpu_per_req_s": [r["p_cpu_per_req_s"] for r in kv],
        "d_cpu_per_req_s": [r["d_cpu_per_req_s"] for r in kv],
        "raw_gbps": a["raw_on"],
        "raw_nomerge_gbps": a["raw_off"],
        "raw_cpu_per_req_s": a["raw_cpu"],
        "pvw_gbps": a["pvw"],
    }


def _run_lens(a: Rounds) -> RunLens:
    """Mean run length of the ids P's and D's allocations got (median over rounds)."""
    kv = a["kv"]
    return {
        "run_len_p": median([r["run_len_p"] for r in kv]),
        "run_len_d": median([r["run_len_d"] for r in kv]),
    }


def _kvpush(
    pw: Worker, dw: Worker, prefix: str, n: int, shape: Shape, blocks: int, inflight: int
) -> KvPass:
    regions = shape.regions
    r, c0, c1 = ClosedLoop(pw, dw, prefix, n, blocks, inflight).timed(120.0, wait_s=600.0)
    lp = pw.call("model_recorded", reply=dict[str, list[int]], prefix=prefix)
    ld = dw.call("model_recorded", reply=dict[str, list[int]], prefix=prefix)
    keys = sorted(set(lp) & set(ld), key=lambda k: int(k.rsplit(".", 1)[1]))
    pairs = [[lp[k], ld[k]] for k in keys]
    descs = [merged_descriptors(_arr(a), _arr(b), regions) for a, b in pairs]
    ok = sum(1 for x in r["ok"] if x)
    el = r["elapsed_s"]
    return {
        "gbps": ok * blocks * shape.block_bytes_all_regions / el / 1e9 if el > 0 else math.nan,
        "per_s": ok / el if el > 0 else math.nan,
        "failed": n - ok,
        "writer_cpu_per_req_s": (c1.get("push-writer", 0.0) - c0.get("push-writer", 0.0)) / n,
        "p_cpu_per_req_s": (c1["process"] - c0["process"]) / n,
        "d_cpu_per_req_s": r["cpu_s"] / n,
        "descs_mean": sum(descs) / len(descs) if descs else math.nan,
        "descs_max": max(descs, default=0),
        "run_len_p": _mean_run_len([a for a, _ in pairs]),
        "run_len_d": _mean_run_len([b for _, b in pairs]),
        "pairs": pairs,
    }


def _verified_pass(
    pw: Worker, dw: Worker, prefix: str, inflight: int, blocks: int
) -> tuple[int, int]:
    """P writes the pattern, D checks every byte, on the pools as the pattern left them."""
    nv = max(2, inflight)
    try:
        v = ClosedLoop(pw, dw, prefix, nv, blocks, inflight).verified(300.0, call_timeout=600)
    finally:
        dw.call("set_verify", verify=False)
    pw.call("model_recorded", prefix=prefix)
    dw.call("model_recorded", prefix=prefix)
    return sum(1 for x in v["verified"] if x is True), nv


def _arr(ids: list[int]) -> npt.NDArray[np.int64]:
    import numpy as np

    return np.asarray(ids, dtype=np.int64)


def _mean_run_len(id_lists: list[list[int]]) -> float:
    """Blocks / runs of consecutive ascending ids, over these allocations."""
    from kvpush.memory.fragmentation import runs_in

    blocks = sum(len(x) for x in id_lists)
    runs = sum(runs_in(_arr(x)) for x in id_lists)
    return blocks / runs if runs else math.nan
