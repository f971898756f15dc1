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
seeded churn of mixed request sizes and lifetimes, ``kvpush.bench.churn``) and
``churn-freelist`` (the same churn on the plain free list kvpush used before). Both P and D
pools churn (different seeds). Descriptors per WRITE are counted from the ids each request
really got (``memory.descriptors.merged_descriptors``); CPU per request from the P writer
thread, the P process and the D process.

Plus, in the orchestrator, the cost of ``allocate``/``release`` from 1- to 64k-block pools.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpush.bench.churn import ChurnSpec, alloc_cost
from kvpush.bench.common import Progress, endpoint_cfg, logs_dir
from kvpush.bench.procs import Cluster, Worker
from kvpush.bench.report import Panel, Report, Series, fmt_num, line_chart
from kvpush.bench.stats import median, ratio
from kvpush.memory.allocator import BlockAllocator, FreeListAllocator
from kvpush.memory.descriptors import merged_descriptors
from kvpush.memory.shapes import SHAPES, Shape

PATTERNS = ("contiguous", "shuffled", "churn", "churn-freelist")
#: pattern -> (allocator, shuffled order, churn first)
_PATTERN = {
    "contiguous": ("extent", False, False),
    "shuffled": ("freelist", True, False),
    "churn": ("extent", False, True),
    "churn-freelist": ("freelist", False, True),
}
FULL_TOKENS = (512, 2048, 8192)
QUICK_TOKENS = (512,)
#: Pool blocks per shape (P and D alike): 3.0, 2.5 and 2.7 GiB.
FULL_POOL_BLOCKS = {"llama-8b": 1536, "llama-70b-tp8": 4096, "mla": 640}
QUICK_POOL_BLOCKS = 1024
QUICK_LAYERS = 2
FULL_BUDGET = 512 << 20  # bytes per measurement (at least 2 x in flight requests)
QUICK_BUDGET = 16 << 20
FULL_ROUNDS = 5
FULL_CHURN = ChurnSpec(seed=1, steps=4000, occupancy=0.9, min_tokens=64, max_tokens=8192)
QUICK_CHURN = ChurnSpec(seed=1, steps=600, occupancy=0.9, min_tokens=64, max_tokens=2048)
COST_POOLS_FULL = (1, 16, 256, 4096, 65536)
COST_POOLS_QUICK = (1, 256, 4096)
COST_SERIES = {"1 block": (1,), "1-16 blocks": (1, 2, 3, 4, 6, 8, 12, 16)}
SEED_P, SEED_D = 11, 22

COLORS = {
    "contiguous": "#1f77b4",
    "shuffled": "#d62728",
    "churn": "#2ca02c",
    "churn-freelist": "#ff7f0e",
}


def inflight_for(request_bytes: int) -> int:
    """Requests D keeps outstanding: at least 2, so that the next WRITE is always posted while
    one completes (with 1, every request would also time D's completion -> next PUSH_REG round
    trip, which raw NIXL's back-to-back loop never waits for); 4 for requests up to 64 MiB."""
    return 4 if request_bytes <= 64 << 20 else 2


@dataclass(frozen=True)
class _Plan:
    quick: bool
    shapes: tuple[Shape, ...]
    tokens: tuple[int, ...]
    pool_blocks: dict[str, int]
    budget: int
    rounds: int
    churn: ChurnSpec

    @staticmethod
    def make(quick: bool) -> _Plan:
        if quick:
            shapes = tuple(s.with_layers(QUICK_LAYERS) for s in SHAPES.values())
            return _Plan(
                True,
                shapes,
                QUICK_TOKENS,
                {s.name: QUICK_POOL_BLOCKS for s in shapes},
                QUICK_BUDGET,
                1,
                QUICK_CHURN,
            )
        return _Plan(
            False,
            tuple(SHAPES.values()),
            FULL_TOKENS,
            dict(FULL_POOL_BLOCKS),
            FULL_BUDGET,
            FULL_ROUNDS,
            FULL_CHURN,
        )


def run(quick: bool, out_dir: Path, progress: Progress) -> dict[str, Any]:
    plan = _Plan.make(quick)
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
    cells: list[dict[str, Any]] = []
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
    _report(rep, plan, cells, cost, out_dir)
    return rep.to_dict()


# --------------------------------------------------------------------------- allocation cost


def _alloc_costs(quick: bool) -> list[dict[str, Any]]:
    pools = COST_POOLS_QUICK if quick else COST_POOLS_FULL
    ops = 500 if quick else 20000
    rounds = 1 if quick else 3
    out = []
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


def _endpoint(role: str, shape: Shape, num_blocks: int) -> dict[str, Any]:
    cfg = endpoint_cfg(
        role,
        layers=shape.layers,
        block_bytes=shape.page_bytes,
        num_blocks=num_blocks,
        verify=False,
    )
    cfg["pool"]["dtype"] = shape.dtype
    if shape.regions_per_layer != 2:
        cfg["pool"]["regions_per_layer"] = shape.regions_per_layer
    return cfg


def _specs(shape: Shape, plan: _Plan) -> dict[str, dict[str, Any]]:
    nb = plan.pool_blocks[shape.name]
    tag = shape.name.replace("/", "-")
    return {f"p-{tag}": _endpoint("prefill", shape, nb), f"d-{tag}": _endpoint("decode", shape, nb)}


def _shape(
    cl: Cluster,
    shape: Shape,
    plan: _Plan,
    progress: Progress,
    started: dict[str, Worker] | None = None,
) -> list[dict[str, Any]]:
    """Every (size, pattern) cell of one shape, on one P/D pair (started here, or ``started``
    already), stopped at the end."""
    nb = plan.pool_blocks[shape.name]
    progress(f"model: {shape.describe()}, pools of {nb} blocks")
    specs = _specs(shape, plan)
    ws = started if started is not None else cl.endpoints(specs, timeout_s=180.0)
    pw, dw = (ws[name] for name in specs)
    # The raw target polls like kvpush's D receiver (spin 2 ms after activity, then sleep up
    # to 1 ms): at these sizes polling back to back was no faster and takes a core.
    target = dw.call("raw_pool_node", poll="backoff", paused=True, call_timeout=300)
    pw.call("raw_pool_node", poll="none", paused=True, call_timeout=300)
    pw.call("raw_prepare", target=target, call_timeout=300)
    # Warm the P->D path once (handshake, UCX wire-up) before anything is timed.
    _setup(pw, dw, shape, "contiguous", nb, plan)
    t0 = plan.tokens[0]
    _kvpush(pw, dw, f"{shape.name}.warm.", 8, shape, shape.blocks_for(t0), 4)
    cells = []
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
    pw: Worker, dw: Worker, shape: Shape, pattern: str, need: int, plan: _Plan
) -> dict[str, Any]:
    """Fresh allocators of the pattern's policy on P and D, churned if the pattern says so
    (seeded: the same pools every time). Returns what each side's pool looks like."""
    kind, shuffled, do_churn = _PATTERN[pattern]
    out: dict[str, Any] = {}
    for side, w, seed in (("p", pw, SEED_P), ("d", dw, SEED_D)):
        w.call("model_pool", kind=kind, order_seed=seed if shuffled else None, call_timeout=60)
        if do_churn:
            spec = {**asdict(plan.churn), "seed": plan.churn.seed + seed}
            out[side] = w.call(
                "model_churn",
                spec=spec,
                block_tokens=shape.block_tokens,
                need_blocks=need,
                call_timeout=300,
            )
        else:
            out[side] = {"fragmentation": w.call("model_frag")}
    return out


def _size(
    pw: Worker,
    dw: Worker,
    target: dict[str, Any],
    shape: Shape,
    nb: int,
    tokens: int,
    plan: _Plan,
    progress: Progress,
) -> list[dict[str, Any]]:
    """One request size, every pattern. Each round measures all four patterns back to back
    (in a rotating order), each as: pools set up, a kvpush pass, then raw NIXL (merge on,
    merge off) and process_vm_writev replaying the ids that pass got -- so that every ratio
    is taken between measurements seconds apart, round by round."""
    blocks = shape.blocks_for(tokens)
    req_bytes = shape.request_bytes(tokens)
    inflight = inflight_for(req_bytes)
    n = max(3 * inflight, math.ceil(plan.budget / req_bytes))
    need = min(nb, inflight * blocks)  # what the in-flight requests hold, on either side
    acc: dict[str, dict[str, Any]] = {
        p: {"kv": [], "raw_on": [], "raw_off": [], "pvw": [], "raw_cpu": []} for p in PATTERNS
    }
    pools: dict[str, Any] = {}
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
            pairs = r["pairs"]
            dw.call("raw_poll", on=True)
            try:
                r_on, r_off = (
                    pw.call(
                        "raw_pairs_loop",
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
            a["pvw"].append(
                pw.call("pvw_pairs", target=target, pairs=pairs, n=n, call_timeout=900)["gbps"]
            )
    cells = []
    for pattern in PATTERNS:
        _setup(pw, dw, shape, pattern, need, plan)
        verified, nv = _verified_pass(
            pw, dw, f"{shape.name}.{tokens}.{pattern}.v.", inflight, blocks
        )
        a = acc[pattern]
        kv = a["kv"]
        cells.append(
            {
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
                "verified": verified,
                "verify_requests": nv,
                "pool": pools[pattern],
                "run_len_p": median([r["run_len_p"] for r in kv]),
                "run_len_d": median([r["run_len_d"] for r in kv]),
            }
        )
    return cells


def _kvpush(
    pw: Worker, dw: Worker, prefix: str, n: int, shape: Shape, blocks: int, inflight: int
) -> dict[str, Any]:
    regions = shape.regions
    fp = pw.call_async("finish_many", prefix=prefix, n=n, blocks=blocks)
    c0 = pw.call("cpu")
    r = dw.call(
        "decode_many",
        p_addr=pw.address,
        prefix=prefix,
        n=n,
        blocks=blocks,
        inflight=inflight,
        wait_s=600.0,
        call_timeout=900,
    )
    c1 = pw.call("cpu")
    fp.result(120)
    lp = pw.call("model_recorded", prefix=prefix)
    ld = dw.call("model_recorded", prefix=prefix)
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
    dw.call("set_verify", verify=True)
    try:
        fv = pw.call_async("prefill_many", prefix=prefix, n=nv, blocks=blocks)
        v = dw.call(
            "decode_many",
            p_addr=pw.address,
            prefix=prefix,
            n=nv,
            blocks=blocks,
            inflight=inflight,
            call_timeout=600,
        )
        fv.result(300)
    finally:
        dw.call("set_verify", verify=False)
    pw.call("model_recorded", prefix=prefix)
    dw.call("model_recorded", prefix=prefix)
    return sum(1 for x in v["verified"] if x is True), nv


def _arr(ids: list[int]) -> Any:
    import numpy as np

    return np.asarray(ids, dtype=np.int64)


def _mean_run_len(id_lists: list[list[int]]) -> float:
    """Blocks / runs of consecutive ascending ids, over these allocations."""
    from kvpush.memory.allocator import runs_in

    blocks = sum(len(x) for x in id_lists)
    runs = sum(runs_in(_arr(x)) for x in id_lists)
    return blocks / runs if runs else math.nan


# --------------------------------------------------------------------------- report


def _per_round(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[k] / b[k]``: measurements of the same round were taken
    seconds apart, so a noisy minute on a shared host hits both sides of each ratio."""
    return median([ratio(x, y) for x, y in zip(a, b, strict=True)])


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%" if math.isfinite(x) else "-"


def _ms(s: float) -> str:
    return fmt_num(s * 1e3, 2) if math.isfinite(s) else "-"


def _report(
    rep: Report,
    plan: _Plan,
    cells: list[dict[str, Any]],
    cost: list[dict[str, Any]],
    out_dir: Path,
) -> None:
    figs = []
    for c in cells:
        kv, raw = median(c["kvpush_gbps"]), median(c["raw_gbps"])
        figs.append(
            {
                **{k: v for k, v in c.items() if k != "pool"},
                "kvpush_median_gbps": kv,
                "kvpush_median_per_s": median(c["kvpush_per_s"]),
                "raw_median_gbps": raw,
                "raw_nomerge_median_gbps": median(c["raw_nomerge_gbps"]),
                "pvw_median_gbps": median(c["pvw_gbps"]),
                "kvpush_over_raw": _per_round(c["kvpush_gbps"], c["raw_gbps"]),
                "writer_ms_per_req": median(c["writer_cpu_per_req_s"]) * 1e3,
                "p_ms_per_req": median(c["p_cpu_per_req_s"]) * 1e3,
                "d_ms_per_req": median(c["d_cpu_per_req_s"]) * 1e3,
                "raw_ms_per_req": median(c["raw_cpu_per_req_s"]) * 1e3,
                "pool": c["pool"],
            }
        )
    by = {(f["shape"], f["tokens"], f["pattern"]): f for f in figs}
    for shape in plan.shapes:
        rows = []
        for f in (f for f in figs if f["shape"] == shape.name):
            rows.append(
                [
                    f"{f['tokens']:,}",
                    f["pattern"],
                    str(f["inflight"]),
                    f"{f['descs_per_write']:,.0f} / {f['descs_unmerged']:,}",
                    fmt_num(f["kvpush_median_gbps"]),
                    fmt_num(f["kvpush_median_per_s"], 1),
                    fmt_num(f["raw_median_gbps"]),
                    fmt_num(f["raw_nomerge_median_gbps"]),
                    fmt_num(f["pvw_median_gbps"]),
                    _pct(f["kvpush_over_raw"]),
                    _ms(f["writer_ms_per_req"] / 1e3),
                    _ms(f["p_ms_per_req"] / 1e3),
                    _ms(f["d_ms_per_req"] / 1e3),
                    f"{f['verified']}/{f['verify_requests']}",
                ]
            )
        rep.table(
            f"{shape.describe()}; pools of {plan.pool_blocks[shape.name]:,} blocks "
            "(GB/s and requests/s: median of rounds)",
            [
                "tokens",
                "ids",
                "in flight",
                "desc/WRITE merged / unmerged",
                "kvpush GB/s",
                "kvpush req/s",
                "raw NIXL",
                "raw, merge off",
                "process_vm_writev",
                "kvpush/raw",
                "P writer ms/req",
                "P ms/req",
                "D ms/req",
                "verified",
            ],
            rows,
            note="kvpush/raw = median over rounds of the ratio within each round. "
            "desc/WRITE = descriptors a WRITE needs once runs of consecutive P *and* D ids "
            "merge (mean over the requests of a round, median of rounds), beside one per block "
            "per region. raw NIXL replays the same (P ids, D ids) pairs kvpush's previous pass "
            "got, from a second agent registering the same pools; process_vm_writev copies "
            "the same bytes with one iovec per merged run per region. CPU per request: P's "
            "writer thread, P's whole process (incl. the bench's stand-in model that marks "
            "blocks finished) and D's whole process.",
        )
    # pools after churn
    prow = []
    for f in figs:
        if not f["pattern"].startswith("churn"):
            continue
        d, p = f["pool"]["d"], f["pool"]["p"]
        prow.append(
            [
                f["shape"],
                f"{f['tokens']:,}",
                "extent (kvpush)" if f["pattern"] == "churn" else "free list",
                f"{d['resident_blocks'] / d['fragmentation']['total'] * 100:.0f}% / "
                f"{p['resident_blocks'] / p['fragmentation']['total'] * 100:.0f}%",
                f"{d['churn_mean_run_len']:.1f} / {p['churn_mean_run_len']:.1f}",
                f"{d['fragmentation']['free_runs']} / {p['fragmentation']['free_runs']}",
                f"{d['fragmentation']['largest_free_run']} / "
                f"{p['fragmentation']['largest_free_run']}",
                f"{f['run_len_d']:.1f} / {f['run_len_p']:.1f}",
                f"{f['blocks']}",
            ]
        )
    if prow:
        rep.table(
            "pools as churn left them (D / P)",
            [
                "shape",
                "tokens",
                "allocator",
                "residents",
                "churn alloc run len",
                "free runs",
                "largest free run",
                "measured run len",
                "request blocks",
            ],
            prow,
            note=f"churn: {plan.churn.steps} requests of {plan.churn.min_tokens}-"
            f"{plan.churn.max_tokens} tokens (log-uniform), exponential lifetimes for "
            f"{plan.churn.occupancy:.0%} occupancy, then residents finished in seeded order "
            "until the in-flight measured requests fit. 'churn alloc run len' = mean run "
            "length of churn's own allocations; 'measured run len' = of the measured requests.",
        )
    _cost_table(rep, cost)
    _targets(rep, plan, by, cost)
    rep.figures["cells"] = figs
    rep.figures["alloc_cost"] = [{k: v for k, v in c.items() if k != "rounds"} for c in cost]
    rep.data["alloc_cost_rounds"] = cost
    _chart(rep, plan, by, out_dir)


def _cost_table(rep: Report, cost: list[dict[str, Any]]) -> None:
    rows = []
    for series in COST_SERIES:
        pools = sorted({c["num_blocks"] for c in cost if c["series"] == series})
        for n in pools:
            e, fl = (
                next(
                    c
                    for c in cost
                    if (c["series"], c["allocator"], c["num_blocks"]) == (series, name, n)
                )
                for name in ("extent", "freelist")
            )
            rows.append(
                [
                    series,
                    f"{n:,}",
                    fmt_num(e["allocate_ns"] / 1e3),
                    fmt_num(e["release_ns"] / 1e3),
                    f"{e['max_free_runs']:,}",
                    fmt_num(fl["allocate_ns"] / 1e3),
                    fmt_num(fl["release_ns"] / 1e3),
                ]
            )
    rep.table(
        "allocation cost (us per call: median of 100-call batch means, median of rounds), "
        "steady churn at 50% occupancy",
        [
            "requests",
            "pool blocks",
            "extent allocate",
            "extent release",
            "extent max free runs",
            "free list allocate",
            "free list release",
        ],
        rows,
        note="In the orchestrator process, one thread: a seeded churn of random-lifetime "
        "requests; each call timed on its own (perf_counter_ns), after a warm-up that fills "
        "and churns the pool once; the median of 100-call batch means keeps a preemption by "
        "another process from deciding the figure. Includes returning a fresh numpy array of "
        "the ids. 'max free runs': the most free runs the extent allocator held (its "
        "SortedList size).",
    )


def _targets(
    rep: Report,
    plan: _Plan,
    by: dict[tuple[str, int, str], dict[str, Any]],
    cost: list[dict[str, Any]],
) -> None:
    rep.notes.append(
        "each ratio in the targets is the median over rounds of the ratio within a round (all "
        "four id patterns, raw NIXL and process_vm_writev are measured seconds apart in every "
        "round); the GB/s beside it are the medians of rounds"
    )
    for shape in plan.shapes:
        for t in plan.tokens:
            f = by[(shape.name, t, "contiguous")]
            r = f["kvpush_over_raw"]
            rep.target(
                f"contiguous ids, {shape.name}, {t:,} tokens: kvpush / raw NIXL",
                ">= 90%",
                f"{_pct(r)} ({fmt_num(f['kvpush_median_gbps'])} / "
                f"{fmt_num(f['raw_median_gbps'])} GB/s)",
                r >= 0.9 if math.isfinite(r) else None,
            )
    for shape in plan.shapes:
        for t in plan.tokens:
            c, fresh = by[(shape.name, t, "churn")], by[(shape.name, t, "contiguous")]
            r = _per_round(c["kvpush_gbps"], fresh["kvpush_gbps"])
            rep.target(
                f"after churn, {shape.name}, {t:,} tokens: kvpush / kvpush on a fresh pool",
                ">= 80%",
                f"{_pct(r)} ({fmt_num(c['kvpush_median_gbps'])} / "
                f"{fmt_num(fresh['kvpush_median_gbps'])} GB/s)",
                r >= 0.8 if math.isfinite(r) else None,
            )
    for shape in plan.shapes:
        if shape.page_bytes != 4096:
            continue
        for t in plan.tokens:
            c, fl = by[(shape.name, t, "churn")], by[(shape.name, t, "churn-freelist")]
            r = _per_round(c["kvpush_gbps"], fl["kvpush_gbps"])
            rep.target(
                f"4 KiB pages ({shape.name}) after churn, {t:,} tokens: kvpush's allocator / "
                "the same churn on a plain free list",
                ">= 3x",
                f"{r:.2f}x ({fmt_num(c['kvpush_median_gbps'])} / "
                f"{fmt_num(fl['kvpush_median_gbps'])} GB/s; {c['descs_per_write']:,.0f} vs "
                f"{fl['descs_per_write']:,.0f} descriptors per WRITE)",
                r >= 3.0 if math.isfinite(r) else None,
            )
    for series in COST_SERIES:
        ext = [c for c in cost if c["series"] == series and c["allocator"] == "extent"]
        if not ext:
            continue
        lo = min(ext, key=lambda c: c["allocate_ns"])
        hi = max(ext, key=lambda c: c["allocate_ns"])
        spread = hi["allocate_ns"] / lo["allocate_ns"]
        pools = [c["num_blocks"] for c in ext]
        rep.target(
            f"allocation cost, {min(pools):,} -> {max(pools):,}-block pools, requests of "
            f"{series}: largest / smallest us per allocate",
            "<= 2x",
            f"{spread:.2f}x ({fmt_num(hi['allocate_ns'] / 1e3)} us at {hi['num_blocks']:,} "
            f"blocks, {fmt_num(lo['allocate_ns'] / 1e3)} us at {lo['num_blocks']:,})",
            spread <= 2.0,
        )
        rlo = min(ext, key=lambda c: c["release_ns"])
        rhi = max(ext, key=lambda c: c["release_ns"])
        rep.target(
            f"release cost, same pools, requests of {series}: largest / smallest us per release",
            "(no target set; shown beside allocate)",
            f"{rhi['release_ns'] / rlo['release_ns']:.2f}x ({fmt_num(rhi['release_ns'] / 1e3)} us "
            f"at {rhi['num_blocks']:,} blocks, {fmt_num(rlo['release_ns'] / 1e3)} us at "
            f"{rlo['num_blocks']:,})",
            None,
        )
    bad = [f for f in by.values() if f["verified"] != f["verify_requests"] or f["kvpush_failed"]]
    for f in bad:
        rep.target(
            f"content verified, {f['shape']} {f['tokens']} tokens {f['pattern']}",
            "all",
            f"{f['verified']}/{f['verify_requests']}, {f['kvpush_failed']} failed",
            False,
        )


def _chart(
    rep: Report, plan: _Plan, by: dict[tuple[str, int, str], dict[str, Any]], out_dir: Path
) -> None:
    panels = []
    for shape in plan.shapes:
        series = []
        for pattern in PATTERNS:
            pts = [(float(t), by[(shape.name, t, pattern)]) for t in plan.tokens]
            series.append(
                Series(
                    f"kvpush, {pattern}",
                    [(x, f["kvpush_median_gbps"]) for x, f in pts],
                    color=COLORS[pattern],
                )
            )
            series.append(
                Series(
                    f"raw NIXL, {pattern}",
                    [(x, f["raw_median_gbps"]) for x, f in pts],
                    color=COLORS[pattern],
                    dash=True,
                )
            )
        panels.append(
            Panel(
                title=shape.describe(),
                series=series,
                xlabel="request (tokens, log)",
                ylabel="GB/s",
                logx=True,
                xticks=[(float(t), f"{t:,}") for t in plan.tokens],
            )
        )
    path = out_dir / "model.svg"
    path.write_text(
        line_chart(panels, "model shapes: GB/s by request size and block-id pattern", panel_h=220)
    )
    rep.charts.append(str(path))
