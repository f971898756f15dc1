"""Tables, targets and chart of ``kvpush bench model`` (``kvpush.commands.bench.model``): pure
functions of the measured cells (no I/O but the chart file)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.commands.bench.chart import Panel, Series, line_chart
from kvpush.commands.bench.report import Report, fmt_num
from kvpush.commands.bench.stats import median, ratio

if TYPE_CHECKING:
    from kvpush.commands.bench.model_cells import AllocCost, Cell, CellFigures, Medians
    from kvpush.commands.bench.model_plan import Plan

PATTERNS = ("contiguous", "shuffled", "churn", "churn-freelist")
COST_SERIES = {"1 block": (1,), "1-16 blocks": (1, 2, 3, 4, 6, 8, 12, 16)}

COLORS = {
    "contiguous": "#1f77b4",
    "shuffled": "#d62728",
    "churn": "#2ca02c",
    "churn-freelist": "#ff7f0e",
}


def _per_round(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[k] / b[k]``: measurements of the same round were taken
    seconds apart, so a noisy minute on a shared host hits both sides of each ratio."""
    return median([ratio(x, y) for x, y in zip(a, b, strict=True)])


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%" if math.isfinite(x) else "-"


def _ms(s: float) -> str:
    return fmt_num(s * 1e3, 2) if math.isfinite(s) else "-"


def report(
    rep: Report,
    plan: Plan,
    cells: list[Cell],
    cost: list[AllocCost],
    out_dir: Path,
) -> None:
    figs: list[CellFigures] = []
    out: list[dict[str, object]] = []  # the figures' JSON: the cell, its medians, its pools
    for c in cells:
        kv, raw = median(c["kvpush_gbps"]), median(c["raw_gbps"])
        m: Medians = {
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
        }
        figs.append({**c, **m})
        out.append({**{k: v for k, v in c.items() if k != "pool"}, **m, "pool": c["pool"]})
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
        if "resident_blocks" not in d or "resident_blocks" not in p:
            continue  # a churn pattern's pools always churned
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
    rep.figures["cells"] = out
    rep.figures["alloc_cost"] = [{k: v for k, v in c.items() if k != "rounds"} for c in cost]
    rep.data["alloc_cost_rounds"] = cost
    _chart(rep, plan, by, out_dir)


def _cost_table(rep: Report, cost: list[AllocCost]) -> None:
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


def _share_target(
    rep: Report, name: str, floor: float, r: float, gbps: tuple[float, float]
) -> None:
    """The target "``r`` >= ``floor``" for a share of two median rates (``gbps``: the numerator's
    and the denominator's), shown as a percent with the rates beside it."""
    rep.target(
        name,
        f">= {floor:.0%}",
        f"{_pct(r)} ({fmt_num(gbps[0])} / {fmt_num(gbps[1])} GB/s)",
        r >= floor if math.isfinite(r) else None,
    )


def _cost_targets(rep: Report, cost: list[AllocCost]) -> None:
    """The allocator's cost per allocate (and release) from the smallest to the largest pool."""
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


def _targets(
    rep: Report,
    plan: Plan,
    by: dict[tuple[str, int, str], CellFigures],
    cost: list[AllocCost],
) -> None:
    rep.notes.append(
        "each ratio in the targets is the median over rounds of the ratio within a round (all "
        "four id patterns, raw NIXL and process_vm_writev are measured seconds apart in every "
        "round); the GB/s beside it are the medians of rounds"
    )
    for shape in plan.shapes:
        for t in plan.tokens:
            f = by[(shape.name, t, "contiguous")]
            _share_target(
                rep,
                f"contiguous ids, {shape.name}, {t:,} tokens: kvpush / raw NIXL",
                0.9,
                f["kvpush_over_raw"],
                (f["kvpush_median_gbps"], f["raw_median_gbps"]),
            )
    for shape in plan.shapes:
        for t in plan.tokens:
            c, fresh = by[(shape.name, t, "churn")], by[(shape.name, t, "contiguous")]
            _share_target(
                rep,
                f"after churn, {shape.name}, {t:,} tokens: kvpush / kvpush on a fresh pool",
                0.8,
                _per_round(c["kvpush_gbps"], fresh["kvpush_gbps"]),
                (c["kvpush_median_gbps"], fresh["kvpush_median_gbps"]),
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
    _cost_targets(rep, cost)
    bad = [f for f in by.values() if f["verified"] != f["verify_requests"] or f["kvpush_failed"]]
    for f in bad:
        rep.target(
            f"content verified, {f['shape']} {f['tokens']} tokens {f['pattern']}",
            "all",
            f"{f['verified']}/{f['verify_requests']}, {f['kvpush_failed']} failed",
            False,
        )


def _chart(
    rep: Report, plan: Plan, by: dict[tuple[str, int, str], CellFigures], out_dir: Path
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
