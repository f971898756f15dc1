"""Scenario ``handshake``: D->P notif-only vs full handshakes against P pools of growing size.

Per pool size (regions x blocks descriptors, up to 1024 regions), a P process and a D process
with the same geometry (D's pool has 4 blocks: the *remote* pool size is what matters). The D
worker calls ``Endpoint.handshake_to(P, mode)`` -- the real handshake: side-channel round trip,
compatibility checks, ``add_remote_agent``, the remote descriptor list for a full handshake,
then connection warm-up -- alternating notif and full, forgetting P (evict + release) after
each so every handshake starts from nothing. Two warm-up rounds are discarded. Phases come from
``PeerConn.timings``: ``side_channel_s``, ``load_s`` (decode + checks + ``add_remote_agent``),
``prep_s`` (descriptors + ``prep_xfer_dlist``), ``warm_s`` (``make_connection``), ``total_s``.

In the same rounds, ``kvpush.commands.bench.handshake_etcd``: D->P notif-only and P->D full
handshakes with the agent metadata over the side channel vs through NIXL's etcd backend
(``--nixl-metadata etcd``), on a throwaway etcd (skipped, with a note, when none can run).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

from kvpush.commands.bench import handshake_etcd
from kvpush.commands.bench.chart import Panel, Series, line_chart
from kvpush.commands.bench.common import EndpointCfg, Progress, endpoint_cfg, logs_dir
from kvpush.commands.bench.handshake_etcd import PHASE_COLUMNS, PHASES, phase_cells
from kvpush.commands.bench.probes import HandshakeSeries
from kvpush.commands.bench.procs import Cluster, Worker
from kvpush.commands.bench.report import Report, ResultDict, fmt_ms, fmt_x
from kvpush.commands.bench.stats import median, percentile, ratio
from kvpush.config import Role

BLOCK_BYTES = 128  # small blocks: many descriptors without gigabytes of pool
MODES = ("notif", "full")

FULL_SIZES = ((4, 128), (16, 512), (64, 1024), (512, 1024))  # (layers, blocks): regions = 2*layers
QUICK_SIZES = ((4, 128), (64, 1024))


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    sizes = QUICK_SIZES if quick else FULL_SIZES
    repeats = 4 if quick else 15
    warmup = 1 if quick else 2
    cmp_per_round = 1 if quick else 4  # handshakes per round of each kind on each etcd-row pair
    rep = Report(
        "handshake",
        "handshake: D->P notif-only vs full, by P pool size; agent metadata: side channel vs etcd",
        quick,
        params={
            "sizes": [list(s) for s in sizes],
            "block_bytes": BLOCK_BYTES,
            "repeats": repeats,
            "warmup_rounds": warmup,
            "nixl_metadata_descriptors": 2 * handshake_etcd.LAYERS * handshake_etcd.BLOCKS,
            "nixl_metadata_per_round": cmp_per_round,
        },
    )
    rows_by_size: list[dict[str, Any]] = []
    cmp_samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    run_dir = logs_dir(out_dir, "handshake")
    with contextlib.ExitStack() as stack:
        # etcd first: it must outlive the endpoints (they withdraw their metadata on close).
        etcd_url, skipped = handshake_etcd.start_etcd(stack, run_dir, progress)
        if skipped:
            progress("handshake: " + skipped)
        cl = stack.enter_context(Cluster(run_dir))
        progress(
            "handshake: starting a P and a D per pool size: "
            + ", ".join(f"{2 * la * b:,}" for la, b in sizes)
            + " descriptors"
        )
        specs: dict[str, EndpointCfg] = {}
        for layers, blocks in sizes:
            descs = 2 * layers * blocks
            specs[f"p-{descs}"] = endpoint_cfg(
                Role.PREFILL, layers=layers, block_bytes=BLOCK_BYTES, num_blocks=blocks
            )
            specs[f"d-{descs}"] = endpoint_cfg(
                Role.DECODE, layers=layers, block_bytes=BLOCK_BYTES, num_blocks=4
            )
        specs.update(handshake_etcd.specs(etcd_url))
        ws = cl.endpoints(specs, timeout_s=180)
        samples: dict[int, dict[str, list[dict[str, float]]]] = {}
        # Rounds go across sizes (1k, 16k, ... then again), so a busy moment of the host
        # lands on every size alike rather than on one.
        for k in range(warmup + repeats):
            if k == warmup:
                progress(f"handshake: {repeats} measured rounds")
            for layers, blocks in sizes:
                descs = 2 * layers * blocks
                r = ws[f"d-{descs}"].call(
                    "handshake_series",
                    reply=HandshakeSeries,
                    p_addr=ws[f"p-{descs}"].address,
                    modes=list(MODES),
                    repeats=1,
                    call_timeout=300,
                )
                if k >= warmup:
                    acc = samples.setdefault(descs, {m: [] for m in MODES})
                    for m in MODES:
                        acc[m].extend(r[m])
            handshake_etcd.one_round(ws, k, cmp_samples if k >= warmup else None, cmp_per_round)
        for layers, blocks in sizes:
            descs = 2 * layers * blocks
            rows_by_size.append(_entry(ws[f"p-{descs}"], layers, blocks, samples[descs]))
    _report(rep, rows_by_size, out_dir)
    handshake_etcd.report(rep, cmp_samples, skipped)
    return rep.to_dict()


def _entry(
    pw: Worker, layers: int, blocks: int, samples: dict[str, list[dict[str, float]]]
) -> dict[str, Any]:
    """One pool size's row: its geometry, P's metadata sizes and, per mode, the median of
    every phase over the measured rounds (and the p90 and samples of the total)."""
    entry: dict[str, Any] = {
        "layers": layers,
        "regions": 2 * layers,
        "blocks": blocks,
        "descriptors": 2 * layers * blocks,
        "metadata_bytes": pw.call("metadata_sizes", reply=dict[str, int]),
    }
    for m in MODES:
        rows = samples[m]
        entry[m] = {ph: median([row[ph] for row in rows]) for ph in PHASES}
        entry[m]["total_p90_s"] = percentile([row["total_s"] for row in rows], 90)
        entry[m]["samples_total_s"] = [row["total_s"] for row in rows]
    return entry


def _report(rep: Report, sizes: list[dict[str, Any]], out_dir: Path) -> None:
    rows = []
    for e in sizes:
        for m in MODES:
            t = e[m]
            md = e["metadata_bytes"]["agent_full" if m == "full" else "agent_conn_only"]
            rows.append(
                [
                    f"{e['descriptors']:,}",
                    f"{e['regions']} x {e['blocks']}",
                    m,
                    *phase_cells(t, "total_p90_s"),
                    f"{md:,}",
                ]
            )
    rep.table(
        "D->P handshake, median ms per phase",
        [
            "descriptors",
            "regions x blocks",
            "mode",
            *PHASE_COLUMNS,
            "total p90",
            "agent md B",
        ],
        rows,
        note="load agent = metadata decode + checks + add_remote_agent; prep descs = build the "
        "remote descriptor list + prep_xfer_dlist (full only); warm conn = make_connection.",
    )
    rrows = []
    for e in sizes:
        rrows.append(
            [
                f"{e['descriptors']:,}",
                fmt_ms(e["notif"]["total_s"]),
                fmt_ms(e["full"]["total_s"]),
                fmt_x(ratio(e["full"]["total_s"], e["notif"]["total_s"])),
            ]
        )
    rep.table(
        "full / notif-only (median total)",
        ["descriptors", "notif ms", "full ms", "full / notif"],
        rrows,
    )
    notif = [e["notif"]["total_s"] for e in sizes]
    worst = max(notif)
    rep.target(
        "notif-only median at every size",
        "<= 5 ms",
        "max " + fmt_ms(worst) + " ms (" + ", ".join(fmt_ms(x) for x in notif) + ")",
        worst <= 0.005,
    )
    flat = ratio(max(notif), min(notif))
    rep.target(
        "notif-only flat in pool size (largest/smallest median)",
        "<= 1.5x",
        fmt_x(flat),
        flat <= 1.5 if math.isfinite(flat) else None,
    )
    big = sizes[-1]
    r = ratio(big["full"]["total_s"], big["notif"]["total_s"])
    rep.target(
        f"full / notif-only at {big['descriptors']:,} descriptors",
        ">= 10x"
        + ("" if big["descriptors"] >= 1_000_000 else " (asked at ~1M; --quick stops smaller)"),
        fmt_x(r),
        ((r >= 10) if math.isfinite(r) else None) if big["descriptors"] >= 1_000_000 else None,
    )
    rep.figures["sizes"] = [
        {
            "descriptors": e["descriptors"],
            "regions": e["regions"],
            "blocks": e["blocks"],
            "metadata_bytes": e["metadata_bytes"],
            **{f"{m}_{ph}": e[m][ph] for m in MODES for ph in (*PHASES, "total_p90_s")},
        }
        for e in sizes
    ]
    rep.data["samples_total_s"] = {
        str(e["descriptors"]): {m: e[m]["samples_total_s"] for m in MODES} for e in sizes
    }
    xs = [e["descriptors"] for e in sizes]
    panel = Panel(
        title="median handshake time vs remote descriptors",
        series=[
            Series(
                "notif-only total",
                [(x, e["notif"]["total_s"] * 1e3) for x, e in zip(xs, sizes, strict=True)],
                color="#1f77b4",
            ),
            Series(
                "full total",
                [(x, e["full"]["total_s"] * 1e3) for x, e in zip(xs, sizes, strict=True)],
                color="#d62728",
            ),
            Series(
                "full: prep descs",
                [(x, e["full"]["prep_s"] * 1e3) for x, e in zip(xs, sizes, strict=True)],
                color="#ff7f0e",
                dash=True,
            ),
            Series(
                "full: load agent",
                [(x, e["full"]["load_s"] * 1e3) for x, e in zip(xs, sizes, strict=True)],
                color="#9467bd",
                dash=True,
            ),
            Series(
                "notif: warm conn",
                [(x, e["notif"]["warm_s"] * 1e3) for x, e in zip(xs, sizes, strict=True)],
                color="#17becf",
                dash=True,
            ),
        ],
        xlabel="descriptors in P's pool (regions x blocks, log)",
        ylabel="ms (log)",
        logx=True,
        logy=True,
        hlines=[(5.0, "5 ms target (notif-only)")],
        xticks=[(x, f"{x:,}") for x in xs],
    )
    path = out_dir / "handshake.svg"
    path.write_text(line_chart([panel], "handshake: D->P notif-only vs full"))
    rep.charts.append(str(path))
