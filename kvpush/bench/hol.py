"""Scenario ``hol``: does a slow or dead new peer stall pushes to an established one?

Processes: P-deferred and P-blocking (``--writer deferred`` / ``blocking``), D1 (established,
steady load on both), and per case the joining Ds: a D whose handshake replies take H seconds
(``handshake_reply_delay_s``: its side channel answers late), a D that never answers (replies
delayed for an hour: P's handshake times out), and two slow Ds plus a healthy third one joining
50 ms after them.

Per case and writer mode, in the same run and interleaved (case by case, deferred then
blocking): D1 decodes at a steady rate (open loop, ``steady_decode``) while P prefills the same
transfers on the same schedule; mid-run the new D(s) send one request each to P. Latency is D1's
own ``DecodeRep.latency_s`` (``decode()`` to verified completion), split into *before* (issued
before the join), *during* (issued while the slow handshakes are pending: H, or P's handshake
timeout for the dead peer) and *after*.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpush.bench import noise
from kvpush.bench.chart import Panel, Series, line_chart
from kvpush.bench.common import (
    PREFILL_AHEAD_S,
    Progress,
    endpoint_cfg,
    logs_dir,
    start_at,
    warmup_s,
)
from kvpush.bench.procs import Cluster, Worker
from kvpush.bench.report import Report, fmt_ms, fmt_x
from kvpush.bench.stats import median, ratio, summary, window

NEVER_S = 3600.0  # "never": the joining D answers handshakes after an hour


@dataclass(frozen=True)
class HolParams:
    rate: float  # D1 requests per second (open loop)
    blocks: int
    layers: int
    block_bytes: int
    num_blocks: int
    before_s: float
    delay_s: float  # H: how late a slow peer answers handshakes
    timeout_s: float  # P's side-channel/handshake timeout: the dead peer's stall
    after_s: float
    repeats: int  # every (case, writer) window is run this many times with fresh new peers


FULL = HolParams(
    rate=200,
    blocks=1,
    layers=2,
    block_bytes=16384,
    num_blocks=2048,
    before_s=2.0,
    delay_s=2.0,
    timeout_s=3.0,
    after_s=1.0,
    repeats=3,
)
QUICK = HolParams(
    rate=100,
    blocks=1,
    layers=2,
    block_bytes=16384,
    num_blocks=512,
    before_s=0.4,
    delay_s=0.3,
    timeout_s=0.6,
    after_s=0.2,
    repeats=1,
)

MODES = ("deferred", "blocking")


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    joiners: tuple[tuple[str, float, float], ...]  # (worker name, reply delay, join offset)
    window_of: str  # "delay" or "timeout"


def _cases(p: HolParams) -> list[Case]:
    return [
        Case(
            "slow",
            f"one new D answers handshakes {p.delay_s:g} s late",
            (("d2-slow", p.delay_s, 0.0),),
            "delay",
        ),
        Case(
            "dead",
            f"one new D never answers (P gives up after {p.timeout_s:g} s)",
            (("d2-dead", NEVER_S, 0.0),),
            "timeout",
        ),
        Case(
            "two-slow+healthy",
            f"two new Ds answer {p.delay_s:g} s late, a healthy third joins 50 ms later",
            (
                ("d2-slow-a", p.delay_s, 0.0),
                ("d2-slow-b", p.delay_s, 0.0),
                ("d3-healthy", 0.0, 0.05),
            ),
            "delay",
        ),
    ]


def run(quick: bool, out_dir: Path, progress: Progress) -> dict[str, Any]:
    p = QUICK if quick else FULL
    rep = Report(
        "hol", "hol: head-of-line blocking behind a slow new peer", quick, params=asdict(p)
    )
    timeouts = {"side_channel_s": p.timeout_s, "handshake_s": p.timeout_s}
    geo: dict[str, Any] = {"layers": p.layers, "block_bytes": p.block_bytes}
    with Cluster(logs_dir(out_dir, "hol")) as cl:
        progress("hol: starting P (deferred), P (blocking) and D1")
        cases = _cases(p)
        # The full run starts each case's joiners just before it (idle endpoints still poll);
        # --quick starts every process at once to save start-up time.
        joiner_specs = {
            c.key: {
                name: endpoint_cfg("decode", **geo, num_blocks=64, reply_delay_s=delay)
                for name, delay, _ in c.joiners
            }
            for c in cases
        }
        early = {n: s for c in cases for n, s in joiner_specs[c.key].items()} if quick else {}
        ws = cl.endpoints(
            {
                **early,
                "p-deferred": endpoint_cfg(
                    "prefill", **geo, num_blocks=p.num_blocks, writer="deferred", timeouts=timeouts
                ),
                "p-blocking": endpoint_cfg(
                    "prefill", **geo, num_blocks=p.num_blocks, writer="blocking", timeouts=timeouts
                ),
                "d1": endpoint_cfg("decode", **geo, num_blocks=p.num_blocks),
            }
        )
        ps = {m: ws[f"p-{m}"] for m in MODES}
        d1 = ws["d1"]
        # D1 joins both Ps in quiet time: the "normal" join (both handshakes + first push).
        normal_join: dict[str, float] = {}
        normal_hs: dict[str, float] = {}
        for m in MODES:
            t = start_at(0.2)
            f = d1.call_async(
                "decode_at",
                p_addr=ps[m].address,
                transfer_id=f"warm.{m}",
                t_wall=t,
                blocks=p.blocks,
            )
            ps[m].call("prefill_at", transfer_id=f"warm.{m}", t_wall=t, blocks=p.blocks)
            r = f.result(60)
            normal_join[m] = r["latency_s"][0]
            _warm(ps[m], d1, p, f"warm2.{m}.")
            normal_hs[m] = _peer_duration(ps[m], d1.address)
        results: dict[str, list[dict[str, Any]]] = {}
        for k in range(p.repeats):
            for case in cases:
                progress(f"hol: repeat {k + 1}/{p.repeats}, case {case.key}: {case.label}")
                if quick:
                    joiners = {name: ws[name] for name in joiner_specs[case.key]}
                else:
                    # Fresh processes every repeat: a peer is new to a P only once.
                    started = cl.endpoints(
                        {f"{n}-r{k}": s for n, s in joiner_specs[case.key].items()}
                    )
                    joiners = {n: started[f"{n}-r{k}"] for n in joiner_specs[case.key]}
                    time.sleep(1.0)  # let the new processes settle before the clock starts
                win = p.delay_s if case.window_of == "delay" else p.timeout_s
                # Alternate which writer goes first, so neither always follows the other.
                for m in MODES if k % 2 == 0 else tuple(reversed(MODES)):
                    progress(f"hol:   writer {m}")
                    results.setdefault(f"{case.key}/{m}", []).append(
                        _window(ps[m], d1, joiners, case, m, win, p, k)
                    )
                if not quick:
                    for w in joiners.values():
                        cl.stop(w)
    _report(rep, p, results, normal_join, normal_hs, out_dir)
    return rep.to_dict()


def _warm(pw: Worker, d1: Worker, p: HolParams, prefix: str) -> None:
    t0 = start_at()
    f = d1.call_async(
        "steady_decode",
        p_addr=pw.address,
        prefix=prefix,
        rate=p.rate,
        t0=t0,
        duration=0.3,
        blocks=p.blocks,
    )
    pw.call(
        "steady_prefill",
        prefix=prefix,
        rate=p.rate,
        t0=t0 - PREFILL_AHEAD_S,
        duration=0.3,
        blocks=p.blocks,
    )
    f.result(60)


def _peer_row(pw: Worker, address: str) -> dict[str, Any]:
    for row in pw.call("stats")["peers"]:
        if row["peer"] == address:
            return dict(row)
    return {}


def _peer_duration(pw: Worker, address: str) -> float:
    """P's handshake duration for a connected peer (NaN when it is not connected)."""
    row = _peer_row(pw, address)
    return float(row["duration_s"]) if row.get("state") == "connected" else math.nan


def _window(
    pw: Worker,
    d1: Worker,
    joiners: dict[str, Worker],
    case: Case,
    mode: str,
    win: float,
    p: HolParams,
    rep: int,
) -> dict[str, Any]:
    total = p.before_s + win + p.after_s
    t0 = start_at()
    t_join = t0 + p.before_s
    prefix = f"{case.key}.{mode}.{rep}."
    wait_s = total + 2 * win + 30
    fd = d1.call_async(
        "steady_decode",
        p_addr=pw.address,
        prefix=prefix,
        rate=p.rate,
        t0=t0,
        duration=total,
        blocks=p.blocks,
        wait_s=wait_s,
    )
    fp = pw.call_async(
        "steady_prefill",
        prefix=prefix,
        rate=p.rate,
        t0=t0 - PREFILL_AHEAD_S,
        duration=total,
        blocks=p.blocks,
    )
    jf = {}
    for name, _, offset in case.joiners:
        tid = f"join.{case.key}.{mode}.{rep}.{name}"
        jf[name] = joiners[name].call_async(
            "decode_at",
            p_addr=pw.address,
            transfer_id=tid,
            t_wall=t_join + offset,
            blocks=p.blocks,
            deadline_s=max(p.timeout_s, 2 * p.delay_s) + p.after_s + 1.0,
            wait_s=wait_s,
        )
        pw.call_async(
            "prefill_at",
            transfer_id=tid,
            t_wall=t_join + offset - PREFILL_AHEAD_S,
            blocks=p.blocks,
        )
    r = fd.result(wait_s + 30)
    p_late = fp.result(60)["max_late_s"]
    joined = {}
    for name, f in jf.items():
        jr = f.result(wait_s + 30)
        joined[name] = {
            "ok": jr["ok"][0],
            "latency_s": jr["latency_s"][0] if jr["ok"][0] else None,
            "reasons": jr["reasons"],
            "p_handshake_s": _peer_duration(pw, joiners[name].address),
            "p_peer_state": _peer_row(pw, joiners[name].address).get("state", "unknown"),
        }
    # Both sides idle before the next window: P has pushed everything, D1 has verified and
    # returned every block (after a blocking stall D1 verifies a backlog of hundreds).
    pw.call("wait_idle", timeout_s=30)
    d1.call("wait_idle", timeout_s=30)
    stalls = [
        [round(ts - t_join, 3), round(late * 1e3, 1)]
        for ts, late in noise.stalls_between(t0, t_join + win + p.after_s + 1.0)
    ]
    t = [x - p.before_s for x in r["t_call"]]  # seconds since the join
    lat, ok = r["latency_s"], r["ok"]
    phases = {}
    for ph, lo, hi in (
        ("before", -p.before_s + warmup_s(p.before_s), 0.0),
        ("during", 0.0, win),
        ("after", win, math.inf),
    ):
        vals, failed = window(t, lat, ok, lo, hi)
        phases[ph] = {**summary(vals), "failed": failed}
    return {
        "phases": phases,
        "window_s": win,
        "joiners": joined,
        "series": [[round(a, 4), round(b, 6)] for a, b, g in zip(t, lat, ok, strict=True) if g],
        "failed": sum(1 for g in ok if not g),
        "reasons": r["reasons"],
        "generator_late_s": {"d1": r["max_late_s"], "p": p_late},
        "host_stalls": stalls,
    }


def _stall_cell(stalls: list[list[float]]) -> str:
    big = [ms for _, ms in stalls if ms > 50]
    return f"{len(big)} (max {max(big):.0f} ms)" if big else "0"


def _med(runs: list[dict[str, Any]], phase: str, stat: str) -> float:
    return median([r["phases"][phase][stat] for r in runs])


def _report(
    rep: Report,
    p: HolParams,
    res: dict[str, list[dict[str, Any]]],
    normal_join: dict[str, float],
    normal_hs: dict[str, float],
    out_dir: Path,
) -> None:
    cases = _cases(p)
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
    jrows = []
    for m in MODES:
        jrows.append(
            ["D1 (quiet, reference)", m, fmt_ms(normal_join[m]), fmt_ms(normal_hs[m]), "ok"]
        )
    for c in cases:
        for m in MODES:
            runs = res[f"{c.key}/{m}"]
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
    figures: dict[str, Any] = {"normal_join_s": normal_join, "normal_p_handshake_s": normal_hs}
    for c in cases:
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

    def third(m: str) -> list[float]:
        js = [r["joiners"]["d3-healthy"] for r in res[f"two-slow+healthy/{m}"]]
        return [j["latency_s"] for j in js if j["latency_s"] is not None]

    ok_d, ok_b = third("deferred"), third("blocking")
    hl = median(ok_d) if len(ok_d) == nrep else None
    ref = median(list(normal_join.values()))
    figures["healthy_third_join_s"] = {"deferred": ok_d, "blocking": ok_b}
    quiet = ", ".join(fmt_ms(v) for v in normal_join.values())
    rep.target(
        "healthy third peer joins in normal time beside two slow ones (deferred)",
        "first request <= 2x a quiet join",
        f"{fmt_ms(hl)} ms vs quiet {fmt_ms(ref)} ms (median of {quiet})"
        if hl is not None
        else "failed",
        (hl <= 2 * ref) if hl is not None and math.isfinite(ref) else False,
        note="a quiet join (D1 joining each P before the run) itself varies about 2x here",
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
                spans=[(0.0, win, "handshake(s) pending")],
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
