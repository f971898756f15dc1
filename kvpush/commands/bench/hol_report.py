"""Tables, targets and chart of ``kvpush bench hol`` (``kvpush.commands.bench.hol``): pure functions
of the measured windows (no I/O but the chart file). Runs in the orchestrator process, on the thread
that runs the scenario, once every window has been measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.commands.bench.chart import Panel, Series, line_chart
from kvpush.commands.bench.common import warmup_s
from kvpush.commands.bench.report import Report, fmt_ms, fmt_x
from kvpush.commands.bench.stats import median, ratio

if TYPE_CHECKING:
    from kvpush.commands.bench.hol import HolWindow
    from kvpush.commands.bench.hol_params import Case, HolParams

#: The two writers compared, in the order a window runs them on even repeats.
MODES = ("deferred", "blocking")


@dataclass(frozen=True)
class Measured:
    """What the scenario measured: the windows (keyed ``case/writer``, one entry per repeat) of
    ``cases``, and D1's quiet joins by writer (its first request; P's handshake with it)."""

    cases: list[Case]
    res: dict[str, list[HolWindow]]
    normal_join: dict[str, float]
    normal_hs: dict[str, float]


def _stall_cell(stalls: list[list[float]]) -> str:
    big = [ms for _, ms in stalls if ms > 50]
    return f"{len(big)} (max {max(big):.0f} ms)" if big else "0"


def _med(runs: list[HolWindow], phase: str, stat: str) -> float:
    return median([r["phases"][phase][stat] for r in runs])


def _latency_table(
    rep: Report, p: HolParams, cases: list[Case], res: dict[str, list[HolWindow]]
) -> None:
    """D1's push latency before, during and after the joins, per case and writer."""
    nrep = p.repeats
    rows = []
    for c in cases:
        for m in MODES:
            runs = res[f"{c.key}/{m}"]
            rows.append(
                [
                    c.key,
                    m,
                    fmt_ms(_med(runs, "before", "p50")),
                    fmt_ms(_med(runs, "before", "p99")),
                    fmt_ms(_med(runs, "during", "p50")),
                    fmt_ms(_med(runs, "during", "p99")),
                    " / ".join(fmt_ms(r["phases"]["during"]["p99"]) for r in runs),
                    fmt_ms(_med(runs, "during", "max")),
                    fmt_ms(_med(runs, "after", "p99")),
                    str(sum(r["phases"][ph]["n"] for r in runs for ph in r["phases"])),
                    str(sum(r["failed"] for r in runs)),
                    _stall_cell([s for r in runs for s in r["host_stalls"]]),
                ]
            )
    each = "each repeat" if nrep > 1 else "the run"
    rep.table(
        f"D1 push latency (ms, D-measured decode() -> verified) at {p.rate:g} req/s, "
        f"{p.blocks} block x {2 * p.layers} regions x {p.block_bytes // 1024} KiB"
        + (f"; median of {nrep} repeats" if nrep > 1 else ""),
        [
            "case",
            "writer",
            "before p50",
            "before p99",
            "during p50",
            "during p99",
            f"during p99, {each}",
            "during max",
            "after p99",
            "requests",
            "failed",
            "host stalls",
        ],
        rows,
        note=f"'before' = requests issued from {warmup_s(p.before_s):g} s after the start of "
        "the window (generators warming up) until the join; "
        "'during' = requests issued while the new peers' handshakes were pending "
        f"({p.delay_s:g} s for slow peers, {p.timeout_s:g} s = P's handshake timeout for the "
        "dead one). 'host stalls' = times the bench's own 5 ms timer thread woke more than "
        "50 ms late during those windows: no CPU was free for it (other jobs, or the "
        "benchmark's own processes).",
    )


def _joiners_table(rep: Report, nrep: int, got: Measured) -> None:
    """Each joining peer's first request and P's handshake with it, beside a quiet join."""
    jrows = []
    for m in MODES:
        quiet = [fmt_ms(got.normal_join[m]), fmt_ms(got.normal_hs[m])]
        jrows.append(["D1 (quiet, reference)", m, *quiet, "ok"])
    for c in got.cases:
        for m in MODES:
            runs = got.res[f"{c.key}/{m}"]
            for name in runs[0]["joiners"]:
                js = [r["joiners"][name] for r in runs]
                lat = [j["latency_s"] for j in js if j["latency_s"] is not None]
                hs = [j["p_handshake_s"] for j in js if j["p_peer_state"] == "connected"]
                states = sorted({j["p_peer_state"] for j in js if j["p_peer_state"] != "connected"})
                reasons = sorted({x for j in js for x in j["reasons"]})
                jrows.append(
                    [
                        f"{c.key}: {name}",
                        m,
                        fmt_ms(median(lat)) if lat else "-",
                        fmt_ms(median(hs)) if hs else f"not connected ({', '.join(states)})",
                        f"{sum(1 for j in js if j['ok'])}/{len(js)} ok"
                        + (f" ({', '.join(reasons)})" if reasons else ""),
                    ]
                )
    rep.table(
        "joining peers: first request (ms, D-measured, both handshakes + push) and "
        "P->D handshake (ms, P telemetry)" + (f", median of {nrep} repeats" if nrep > 1 else ""),
        ["peer", "writer", "first request", "P->D handshake", "outcome"],
        jrows,
    )


def report(rep: Report, p: HolParams, got: Measured, out_dir: Path) -> None:
    """Fill ``rep`` from what the scenario measured; write ``hol.svg`` to ``out_dir``."""
    nrep = p.repeats
    cases, res, normal_join, normal_hs = got.cases, got.res, got.normal_join, got.normal_hs
    _latency_table(rep, p, cases, res)
    _joiners_table(rep, nrep, got)
    figures: dict[str, object] = {"normal_join_s": normal_join, "normal_p_handshake_s": normal_hs}
    for c in cases:
        if c.reference:
            continue
        dfr, blk = res[f"{c.key}/deferred"], res[f"{c.key}/blocking"]
        win = dfr[0]["window_s"]
        d_before, d_during = _med(dfr, "before", "p99"), _med(dfr, "during", "p99")
        b_during = _med(blk, "during", "p99")
        growth = ratio(d_during, d_before)
        contrast = ratio(b_during, d_during)
        figures[c.key] = {
            "deferred_p99_before_s": d_before,
            "deferred_p99_during_s": d_during,
            "blocking_p99_before_s": _med(blk, "before", "p99"),
            "blocking_p99_during_s": b_during,
            "deferred_growth": growth,
            "blocking_over_deferred": contrast,
            "deferred_p99_during_each_s": [r["phases"]["during"]["p99"] for r in dfr],
            "blocking_p99_during_each_s": [r["phases"]["during"]["p99"] for r in blk],
        }
        rep.target(
            f"{c.key}: deferred p99 during / before",
            "<= 2x",
            f"{fmt_x(growth)} ({fmt_ms(d_during)} / {fmt_ms(d_before)} ms)",
            growth <= 2.0 if math.isfinite(growth) else None,
        )
        rep.target(
            f"{c.key}: blocking p99 during",
            f">= {win:g} s (0.95x allowed: requests issued late in the window wait less)",
            f"{fmt_ms(b_during)} ms",
            b_during >= 0.95 * win if math.isfinite(b_during) else None,
        )
        rep.target(
            f"{c.key}: blocking / deferred p99 during",
            ">= 10x",
            fmt_x(contrast),
            contrast >= 10 if math.isfinite(contrast) else None,
        )

    def first(key: str, name: str, m: str) -> list[float]:
        js = [r["joiners"][name] for r in res[f"{key}/{m}"]]
        return [j["latency_s"] for j in js if j["latency_s"] is not None]

    ok_d, ok_b = (
        first("two-slow+healthy", "d3-healthy", "deferred"),
        first("two-slow+healthy", "d3-healthy", "blocking"),
    )
    alone = first("alone", "d3-alone", "deferred")
    hl = median(ok_d) if len(ok_d) == nrep else None
    figures["healthy_third_join_s"] = {"deferred": ok_d, "blocking": ok_b}
    figures["healthy_alone_join_s"] = alone
    # Repeat by repeat: the fresh joiners of one repeat join both Ps, in the same writer order,
    # so in each repeat the third peer and the lone one are both cold (first join of their
    # process) or both warm.
    pairs = list(zip(ok_d, alone, strict=True)) if len(ok_d) == len(alone) == nrep else []
    third_x = median([t / a for t, a in pairs]) if pairs else None
    figures["healthy_third_over_alone"] = third_x
    d1_quiet = ", ".join(fmt_ms(v) for v in normal_join.values())
    each = ", ".join(f"{fmt_ms(t)} / {fmt_ms(a)}" for t, a in pairs)
    rep.target(
        "healthy third peer joins in normal time beside two slow ones (deferred)",
        "first request <= 2x a new peer's joining alone (median over repeats)",
        f"{fmt_x(third_x)} ({each} ms)" if third_x is not None else "failed",
        third_x <= 2.0 if third_x is not None else False,
        note="'alone' = a fresh healthy D joining the same P at the same point of a window with "
        "no slow peer (case 'alone'), in the same repeat: the joiners of a repeat join both Ps "
        "in the same order, so both are cold or both warm; D1's quiet joins before the run: "
        f"{d1_quiet} ms (its first cold, its second warm)",
    )
    hb = median(ok_b) if ok_b else math.nan
    rep.target(
        "healthy third peer is not held behind the slow handshakes (deferred)",
        f"first request < H/10 = {p.delay_s * 100:.0f} ms (blocking writer: >= H)",
        f"{fmt_ms(hl)} ms (blocking writer: {fmt_ms(hb)} ms)" if hl is not None else "failed",
        (hl < p.delay_s / 10) if hl is not None else False,
    )
    late = max(max(v["generator_late_s"].values()) for runs in res.values() for v in runs)
    rep.figures["generator_max_late_s"] = late
    if late > 0.02:
        rep.notes.append(
            f"the open-loop generators fell up to {late * 1e3:.0f} ms behind schedule at some "
            "point: a thread of P or D1 did not get the CPU in time (other jobs, or the endpoints' "
            "own threads: see host noise and BENCHMARKS.md); latencies include such stalls"
        )
    rep.figures.update(figures)
    rep.data["series"] = {k: [r["series"] for r in runs] for k, runs in res.items()}
    rep.data["phases"] = {k: [r["phases"] for r in runs] for k, runs in res.items()}
    rep.data["joiners"] = {k: [r["joiners"] for r in runs] for k, runs in res.items()}
    rep.data["host_stalls"] = {k: [r["host_stalls"] for r in runs] for k, runs in res.items()}
    # chart: D1 latency over time in the first repeat, per case, both writers
    panels = []
    for c in cases:
        win = res[f"{c.key}/deferred"][0]["window_s"]
        series = [
            Series(
                f"writer {m}",
                [(a, b * 1e3) for a, b in res[f"{c.key}/{m}"][0]["series"]],
                color="#1f77b4" if m == "deferred" else "#d62728",
                style="trace",
            )
            for m in MODES
        ]
        panels.append(
            Panel(
                title=f"{c.key}: {c.label}",
                series=series,
                xlabel="seconds since the new peer(s) joined"
                + (" (first repeat)" if nrep > 1 else ""),
                ylabel="D1 latency (ms, log)",
                logy=True,
                spans=[] if c.reference else [(0.0, win, "handshake(s) pending")],
                marks=[x for x, _ in res[f"{c.key}/deferred"][0]["host_stalls"]],
                marks_label="red ticks: host stalls during the deferred run (a 5 ms timer in "
                "the bench woke > 20 ms late)",
            )
        )
    svg = line_chart(
        panels, "hol: D1 push latency while new peers join, deferred vs blocking writer"
    )
    path = out_dir / "hol.svg"
    path.write_text(svg)
    rep.charts.append(str(path))
