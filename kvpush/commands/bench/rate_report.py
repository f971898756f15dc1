"""Tables, targets and notes of ``kvpush bench rate`` (``kvpush.commands.bench.rate``): pure
functions of the measured rounds. Runs in the orchestrator process, on the thread that runs the
scenario, once every configuration has been measured.
"""

from __future__ import annotations

import math
from typing import NotRequired, TypedDict

from kvpush.commands.bench.probes import HistJson, histogram
from kvpush.commands.bench.raw import RawLoopResult
from kvpush.commands.bench.raw_notifs import RawNotifResult
from kvpush.commands.bench.report import Report, fmt_ms, fmt_num
from kvpush.commands.bench.stats import median, ratio


class KvRound(TypedDict):
    """One timed kvpush round (``_kvpush``)."""

    per_s: float
    failed: int
    latency: dict[str, float]
    writer_cpu_us: float
    p_cpu_us: float
    d_cpu_us: float
    d_receiver_cpu_us: float
    d_client_cpu_us: float  # D's load generator: the thread that calls decode()
    writes: int
    pushes_per_write: float
    post_us_per_desc: float
    d_to_p_notifs: NotRequired[int]  # notifications P received in the round (PUSH_REG batches)
    p_to_d_notifs: NotRequired[int]  # ... and D received (completions)
    elapsed_s: NotRequired[float]


class InflightRounds(TypedDict):
    """Every round of one in-flight configuration."""

    n: int
    kvpush: list[KvRound]
    raw: list[RawLoopResult]
    kvpush_d_nospin: list[KvRound]
    kvpush_single: list[KvRound]
    p_hist: NotRequired[dict[str, HistJson | None]]
    raw_notifs: NotRequired[list[RawNotifResult]]  # the first configuration's rounds


def report(rep: Report, out: dict[int, InflightRounds], verified: int, nverify: int) -> None:
    rows = []
    figs: dict[int, dict[str, object]] = {}
    for inflight, e in out.items():
        kv_rate = median([x["per_s"] for x in e["kvpush"]])
        raw_rate = median([x["per_s"] for x in e["raw"]])
        w_us = median([x["writer_cpu_us"] for x in e["kvpush"]])
        raw_us = median([x["thread_cpu_s"] / x["n"] * 1e6 for x in e["raw"]])
        p_us = median([x["p_cpu_us"] for x in e["kvpush"]])
        d_us = median([x["d_cpu_us"] for x in e["kvpush"]])
        d_client_us = median([x.get("d_client_cpu_us", math.nan) for x in e["kvpush"]])
        lat = e["kvpush"][len(e["kvpush"]) // 2]["latency"]
        r = ratio(kv_rate, raw_rate)
        rows.append(
            [
                str(inflight),
                fmt_num(kv_rate, 0),
                fmt_num(raw_rate, 0),
                f"{r * 100:.0f}%" if math.isfinite(r) else "-",
                fmt_num(w_us, 1),
                fmt_num(raw_us, 1),
                fmt_num(w_us - raw_us, 1),
                fmt_num(p_us, 1),
                fmt_num(d_us, 1),
                fmt_ms(lat["p50"], 3),
                fmt_ms(lat["p99"], 3),
                fmt_ms(lat["max"], 3),
            ]
        )
        fig: dict[str, object] = {
            "kvpush_per_s": kv_rate,
            "raw_per_s": raw_rate,
            "ratio": r,
            "writer_cpu_us_per_push": w_us,
            "raw_cpu_us_per_write": raw_us,
            "writer_overhead_us_per_push": w_us - raw_us,
            "kvpush_rounds": e["kvpush"],
            "raw_rounds": [{k: v for k, v in x.items()} for x in e["raw"]],
            "p_histograms": e.get("p_hist"),
        }
        figs[inflight] = rep.figures[f"inflight_{inflight}"] = fig
        if inflight > 1:
            fig["cpu_ceiling_per_s"] = cpu_ceiling(p_us, d_us)
            rep.notes.append(ceiling_note(inflight, p_us, d_us, raw_rate, d_client_us))
            rep.target(
                f"kvpush / raw pushes per second, {inflight} in flight",
                ">= 50%",
                f"{r * 100:.0f}% ({fmt_num(kv_rate, 0)} / {fmt_num(raw_rate, 0)} per s); "
                f"writer overhead {fmt_num(w_us - raw_us, 1)} us/push",
                r >= 0.5 if math.isfinite(r) else None,
            )
    rep.table(
        "pushes per second (median of rounds) and CPU per push (us)",
        [
            "in flight",
            "kvpush/s",
            "raw/s",
            "kvpush/raw",
            "P writer us",
            "raw loop us",
            "writer overhead us",
            "P process us",
            "D process us",
            "lat p50 ms",
            "lat p99 ms",
            "lat max ms",
        ],
        rows,
        note="latency = D-measured decode() -> completion (median round); raw loop us = CPU of "
        "the raw initiator thread per WRITE+notif; writer overhead = P writer us - raw loop us. "
        "With 1 in flight the owner threads spin between pushes (busy_spin_us), so their CPU "
        "per push is mostly waiting, not work.",
    )
    _coalescing(rep, out, figs)
    for inflight, e in out.items():
        ns = e.get("kvpush_d_nospin") or []
        if not ns:
            continue
        kv_rate = median([x["per_s"] for x in e["kvpush"]])
        ns_rate = median([x["per_s"] for x in ns])
        raw_rate = median([x["per_s"] for x in e["raw"]])
        rep.table(
            f"D's receiver without spin-after-activity (busy_spin_us=0), {inflight} in flight, "
            "same rounds",
            ["config", "kvpush/s", "kvpush/raw", "P writer us", "D process us", "lat p50 ms"],
            [
                [
                    name,
                    fmt_num(median([x["per_s"] for x in runs]), 0),
                    f"{ratio(median([x['per_s'] for x in runs]), raw_rate) * 100:.0f}%",
                    fmt_num(median([x["writer_cpu_us"] for x in runs]), 1),
                    fmt_num(median([x["d_cpu_us"] for x in runs]), 1),
                    fmt_ms(median([x["latency"]["p50"] for x in runs]), 3),
                ]
                for name, runs in (("defaults", e["kvpush"]), ("D busy_spin_us=0", ns))
            ],
        )
        figs[inflight]["d_nospin_per_s"] = ns_rate
        figs[inflight]["d_nospin_gain"] = ratio(ns_rate, kv_rate)
        figs[inflight]["d_nospin_rounds"] = ns
    first = next(iter(out.values()))
    ph = first.get("p_hist") or {}
    if ph:
        hists = {name: histogram(raw) for name, raw in ph.items() if raw}
        rep.table(
            "P telemetry histograms over the first configuration's rounds (ms)",
            ["histogram", "count", "p50", "p90", "p99", "max"],
            [
                [
                    name,
                    str(h.count),
                    fmt_ms(h.p50, 3),
                    fmt_ms(h.p90, 3),
                    fmt_ms(h.p99, 3),
                    fmt_ms(h.max, 3),
                ]
                for name, h in hists.items()
            ],
            note="push_latency: P matched blocks with PUSH_REG -> WRITE complete; "
            "write_duration: WRITE posted -> complete (cumulative since P started, incl. "
            "warm-up).",
        )
    rep.figures["verified"] = {"ok": verified, "of": nverify}
    if verified != nverify:
        rep.target("verified pass", "all", f"{verified}/{nverify}", False)
    else:
        rep.notes.append(
            f"verified pass: {verified}/{nverify} pushes written with the pattern by P and "
            "checked byte by byte on D"
        )


def cpu_ceiling(p_us: float, d_us: float) -> float:
    """Pushes per second that P's and D's CPU per push allow, each process on a core of its
    own: the slower side's ``1e6 / us`` (P's writer is one thread and D's receiver another, so
    more cores do not lift it)."""
    worst = max(p_us, d_us)
    return 1e6 / worst if worst > 0 and math.isfinite(worst) else math.nan


def ceiling_note(
    inflight: int, p_us: float, d_us: float, raw_rate: float, d_client_us: float = math.nan
) -> str:
    """Where the small-push rate stops on this host, in words (``cpu_ceiling``). ``d_client_us``:
    the part of D's that its load generator's thread spent calling ``decode()`` (an engine's
    scheduler pays it too: it is in D's figure)."""
    c = cpu_ceiling(p_us, d_us)
    side = "P" if p_us >= d_us else "D"
    client = (
        f" ({fmt_num(d_client_us, 1)} of it in the thread that calls decode())"
        if math.isfinite(d_client_us)
        else ""
    )
    return (
        f"{inflight} in flight: P's process spends {fmt_num(p_us, 1)} us and D's "
        f"{fmt_num(d_us, 1)} us{client} of CPU a push, so even with each on a core of its own "
        "kvpush "
        f"cannot pass {fmt_num(c, 0)} pushes/s here ({ratio(c, raw_rate) * 100:.0f}% of raw "
        f"NIXL): {side}'s per-push CPU, not the fabric, sets the small-push rate"
    )


def _coalescing(
    rep: Report, out: dict[int, InflightRounds], figs: dict[int, dict[str, object]]
) -> None:
    """Coalescing on (the defaults) vs off vs raw NIXL, same rounds: the A/B of issue 30;
    each configuration's figures go into ``figs`` (``rep.figures``' own)."""
    rows = []
    for inflight, e in out.items():
        single = e.get("kvpush_single") or []
        if not single:
            continue
        raw_rate = median([x["per_s"] for x in e["raw"]])
        raw_us = median([x["thread_cpu_s"] / x["n"] * 1e6 for x in e["raw"]])
        fig: dict[str, object] = {"single_rounds": single}
        side: dict[str, dict[str, float]] = {}
        for name, runs in (("coalescing on", e["kvpush"]), ("coalescing off", single)):
            rate = median([x["per_s"] for x in runs])
            w_us = median([x["writer_cpu_us"] for x in runs])
            d_us = median([x["d_cpu_us"] for x in runs])
            lat = runs[len(runs) // 2]["latency"]
            rows.append(
                [
                    str(inflight),
                    name,
                    fmt_num(rate, 0),
                    f"{ratio(rate, raw_rate) * 100:.0f}%",
                    fmt_num(median([x.get("pushes_per_write", math.nan) for x in runs]), 2),
                    fmt_num(median([x.get("post_us_per_desc", math.nan) for x in runs]), 2),
                    fmt_num(w_us, 1),
                    fmt_num(median([x["p_cpu_us"] for x in runs]), 1),
                    fmt_num(d_us, 1),
                    fmt_ms(lat["p50"], 3),
                    fmt_ms(lat["p99"], 3),
                ]
            )
            key = "on" if runs is e["kvpush"] else "off"
            fig[key] = side[key] = {
                "per_s": rate,
                "ratio": ratio(rate, raw_rate),
                "writer_cpu_us": w_us,
            }
        rows.append(
            [
                str(inflight),
                "raw NIXL",
                fmt_num(raw_rate, 0),
                "100%",
                "1.00",
                "-",
                fmt_num(raw_us, 1),
                "-",
                "-",
                "-",
                "-",
            ]
        )
        c = ratio(side["on"]["writer_cpu_us"], side["off"]["writer_cpu_us"])
        fig["writer_cpu_on_over_off"] = c
        fig["rate_on_over_off"] = ratio(side["on"]["per_s"], side["off"]["per_s"])
        figs[inflight]["coalescing"] = fig
        if inflight > 1:
            rep.target(
                f"P writer CPU per push, coalescing on / off, {inflight} in flight",
                "<= 50%",
                f"{c * 100:.0f}% ({fmt_num(side['on']['writer_cpu_us'], 1)} / "
                f"{fmt_num(side['off']['writer_cpu_us'], 1)} us)",
                c <= 0.5 if math.isfinite(c) else None,
            )
    if rows:
        rep.table(
            "coalescing on vs off vs raw NIXL (same rounds; medians)",
            [
                "in flight",
                "config",
                "pushes/s",
                "of raw",
                "pushes/WRITE",
                "post us/desc",
                "P writer us",
                "P process us",
                "D process us",
                "lat p50 ms",
                "lat p99 ms",
            ],
            rows,
            note="coalescing on: pushes ready for one D in a writer pass go as one WRITE + one "
            "Completions notification (the default); off: one WRITE + one Completion each "
            "(--no-coalesce). pushes/WRITE: P's pushes per WRITE posted (median round); "
            "post us/desc: P's time in NIXL's prep+post calls per descriptor "
            "(kvpush.prefill.lanestats). raw NIXL's 'P writer us' is the raw loop's CPU per "
            "WRITE+notif.",
        )
