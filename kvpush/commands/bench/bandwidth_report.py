"""Tables, targets and chart of ``kvpush bench bandwidth`` (``kvpush.commands.bench.bandwidth``):
pure functions of the measured rounds (no I/O but the chart file). Runs in the orchestrator process,
on the thread that runs the scenario, once every size has been measured.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TypedDict

from kvpush.commands.bench.chart import Panel, Series, line_chart
from kvpush.commands.bench.report import Report, fmt_num
from kvpush.commands.bench.stats import median, ratio


class SizeResult(TypedDict):
    """One block size's rounds, as ``kvpush.commands.bench.bandwidth`` measured them."""

    block_bytes: int
    blocks: int
    requests: int
    request_bytes: int
    progress_thread: bool
    kvpush_gbps: list[float]
    kvpush_failed: int
    kvpush_p_cpu: list[float]
    kvpush_writer_cpu: list[float]
    kvpush_d_cpu: list[float]
    kvpush_in_write: list[float]
    kvpush_d_nospin_gbps: list[float]
    kvpush_d_nospin_d_cpu: list[float]
    raw_gbps: list[float]
    pvw_gbps: list[float]
    memcpy_gbps: list[float]
    verified: int
    verify_requests: int


class SizeFigures(SizeResult):
    """One block size's figures: its rounds and their medians and ratios."""

    kvpush_median_gbps: float
    raw_median_gbps: float
    ratio: float
    ratio_best: float
    pvw_median_gbps: float
    memcpy_median_gbps: float


def kib(bs: int) -> str:
    """A block size as people write it: ``256 KiB``, ``4 MiB``."""
    return f"{bs >> 20} MiB" if bs >= 1 << 20 else f"{bs >> 10} KiB"


def report(rep: Report, res: list[SizeResult], pt: SizeResult | None, out_dir: Path) -> None:
    """Fill ``rep`` from the per-size results ``res`` and the progress-thread-on run ``pt``
    (``None`` in ``--quick``); write ``bandwidth.svg`` to ``out_dir``. The request shape is
    read from ``rep.params``, as the run recorded it."""
    blocks, regions, inflight = (
        rep.params[k] for k in ("blocks_per_request", "regions", "inflight")
    )
    rows = []
    figs: list[SizeFigures] = []
    for e in res:
        kv, raw = median(e["kvpush_gbps"]), median(e["raw_gbps"])
        pv = median(e["pvw_gbps"]) if e["pvw_gbps"] else math.nan
        mc = median(e["memcpy_gbps"]) if e["memcpy_gbps"] else math.nan
        r = ratio(kv, raw)
        rb = ratio(max(e["kvpush_gbps"]), max(e["raw_gbps"]))
        rows.append(
            [
                kib(e["block_bytes"]),
                f"{e['request_bytes'] >> 10:,} KiB",
                fmt_num(kv),
                fmt_num(raw),
                f"{r * 100:.0f}%" if math.isfinite(r) else "-",
                f"{rb * 100:.0f}%" if math.isfinite(rb) else "-",
                fmt_num(pv),
                fmt_num(mc),
                f"{median(e['kvpush_in_write']) * 100:.0f}%",
                f"{median(e['kvpush_writer_cpu']) * 100:.0f}% / "
                f"{median(e['kvpush_d_cpu']) * 100:.0f}%",
                f"{e['verified']}/{e['verify_requests']}",
            ]
        )
        figs.append(
            {
                **e,
                "kvpush_median_gbps": kv,
                "raw_median_gbps": raw,
                "ratio": r,
                "ratio_best": rb,
                "pvw_median_gbps": pv,
                "memcpy_median_gbps": mc,
            }
        )
        if e["block_bytes"] >= 256 << 10:
            rep.target(
                f"kvpush / raw NIXL at {kib(e['block_bytes'])} blocks",
                ">= 90%",
                f"{r * 100:.0f}% ({fmt_num(kv)} / {fmt_num(raw)} GB/s)",
                r >= 0.9 if math.isfinite(r) else None,
            )
        if e["verified"] != e["verify_requests"] or e["kvpush_failed"]:
            rep.target(
                f"content verified at {kib(e['block_bytes'])}",
                "all",
                f"{e['verified']}/{e['verify_requests']}, {e['kvpush_failed']} failed",
                False,
            )
    rep.table(
        f"GB/s (median of rounds), {blocks} blocks x {regions} regions per request, "
        f"{inflight} in flight",
        [
            "block",
            "request",
            "kvpush",
            "raw NIXL",
            "kvpush/raw",
            "best/best",
            "process_vm_writev",
            "memcpy",
            "P WRITE time",
            "P writer / D CPU",
            "verified",
        ],
        rows,
        note="best/best = best kvpush round / best raw round (the least disturbed rounds on a "
        "shared host). kvpush timed without D's verification; 'verified' is a separate pass "
        "in which P wrote the pattern and D checked every byte. 'P WRITE time' = P's "
        "write_duration sum (telemetry) / elapsed: near 100% means a WRITE was always in "
        "progress, above 100% that WRITEs overlapped; "
        "CPU = share of one core used by P's writer thread and by D's process during the "
        "kvpush rounds.",
    )
    ns = [e for e in res if e["kvpush_d_nospin_gbps"]]
    if ns:
        rep.table(
            "D's receiver without spin-after-activity (busy_spin_us=0), same rounds (GB/s, median)",
            [
                "block",
                "kvpush defaults",
                "kvpush, D busy_spin_us=0",
                "raw NIXL",
                "D CPU default / 0",
            ],
            [
                [
                    kib(e["block_bytes"]),
                    fmt_num(median(e["kvpush_gbps"])),
                    fmt_num(median(e["kvpush_d_nospin_gbps"])),
                    fmt_num(median(e["raw_gbps"])),
                    f"{median(e['kvpush_d_cpu']) * 100:.0f}% / "
                    f"{median(e['kvpush_d_nospin_d_cpu']) * 100:.0f}%",
                ]
                for e in ns
            ],
            note="After any activity D's receiver keeps polling for busy_spin_us (default 2000 us) "
            "before it sleeps; with a completion every millisecond or two it never sleeps, and on "
            "a 2-core host that CPU is taken from P's writer, whose thread does the copy. A second "
            "P/D pair with D at busy_spin_us=0 ran in the same rounds.",
        )
    if pt is not None:
        kv, raw = median(pt["kvpush_gbps"]), median(pt["raw_gbps"])
        base = next((f for f in figs if f["block_bytes"] == pt["block_bytes"]), None)
        rep.table(
            f"NIXL progress thread ON, {kib(pt['block_bytes'])} blocks (GB/s)",
            ["config", "kvpush", "raw NIXL", "kvpush/raw"],
            [
                ["progress thread on", fmt_num(kv), fmt_num(raw), f"{ratio(kv, raw) * 100:.0f}%"],
                [
                    "progress thread off (kvpush default)",
                    fmt_num(base["kvpush_median_gbps"]) if base else "-",
                    fmt_num(base["raw_median_gbps"]) if base else "-",
                    f"{base['ratio'] * 100:.0f}%" if base else "-",
                ],
            ],
            note="NIXL's Python agent starts a progress thread that spins a core; on a 2-core "
            "host that "
            "costs the WRITE its CPU. kvpush turns it off (--progress-thread to turn it on).",
        )
        rep.figures["progress_thread_on"] = {**pt, "kvpush_median_gbps": kv, "raw_median_gbps": raw}
    rep.figures["sizes"] = figs
    xs = [e["block_bytes"] >> 10 for e in res]
    series = [
        Series(
            "kvpush end-to-end",
            [(x, f["kvpush_median_gbps"]) for x, f in zip(xs, figs, strict=True)],
            color="#1f77b4",
        ),
        Series(
            "raw NIXL WRITE loop",
            [(x, f["raw_median_gbps"]) for x, f in zip(xs, figs, strict=True)],
            color="#d62728",
        ),
        Series(
            "process_vm_writev",
            [(x, f["pvw_median_gbps"]) for x, f in zip(xs, figs, strict=True)],
            color="#2ca02c",
            dash=True,
        ),
        Series(
            "memcpy (1 thread)",
            [(x, f["memcpy_median_gbps"]) for x, f in zip(xs, figs, strict=True)],
            color="#7f7f7f",
            dash=True,
        ),
    ]
    if pt is not None:
        x = pt["block_bytes"] >> 10
        series.append(
            Series("kvpush, progress thread on", [(x, median(pt["kvpush_gbps"]))], color="#9467bd")
        )
        series.append(
            Series("raw NIXL, progress thread on", [(x, median(pt["raw_gbps"]))], color="#ff7f0e")
        )
    panel = Panel(
        title=f"push bandwidth, {blocks} blocks x {regions} regions per request, "
        f"{inflight} in flight",
        series=series,
        xlabel="block size (KiB, log)",
        ylabel="GB/s",
        logx=True,
        xticks=[(x, kib(x << 10)) for x in xs],
    )
    path = out_dir / "bandwidth.svg"
    path.write_text(line_chart([panel], "bandwidth: kvpush vs raw NIXL vs the host's limits"))
    rep.charts.append(str(path))
