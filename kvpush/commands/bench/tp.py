"""Scenario ``tp``: aggregate push bandwidth of N tensor-parallel ranks against N x one rank.

Same host, same rounds. Each rank's page is ``PAGE`` bytes per region (one KV head of the
model per rank, ``kv_heads = N``), ``BLOCKS`` blocks per request, ``INFLIGHT`` requests in
flight (``bandwidth``'s push geometry); D does not verify in the timed part (a verified pass
follows).

* **one rank**: a P and a D endpoint at TP 1 -- the base, ``B1``.
* **N ranks as threads** (kvpush's process model): a P and a D endpoint at TP N, each rank with
  its own NIXL agent, pool and owner thread in one process per endpoint. A request moves N
  pages per block and region, one per rank.
* **N ranks as processes** (the alternative model): N independent TP-1 P/D pairs pushing at the
  same time, one process per rank.

Reported: aggregate GB/s of each, and the ratios threads / (N x B1) and threads / processes --
the measurement behind the README's choice of process model. On a host with fewer cores than
ranks every variant shares the cores; the ratios say how much of the one-rank rate each keeps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TypedDict

from kvpush.commands.bench.bandwidth import BLOCKS, INFLIGHT, PUSH_PARAMS, REGIONS
from kvpush.commands.bench.chart import Panel, Series, line_chart
from kvpush.commands.bench.common import EndpointCfg, Progress, endpoint_cfg, logs_dir
from kvpush.commands.bench.loadgen import DecodeManyResult
from kvpush.commands.bench.passes import ClosedLoop
from kvpush.commands.bench.procs import Cluster, Worker
from kvpush.commands.bench.report import Report, ResultDict, fmt_num
from kvpush.commands.bench.stats import median, ratio
from kvpush.config import Role

PAGE = 256 << 10
FULL_TPS = (1, 2, 4)
QUICK_TPS = (1, 2)


def _cfg(role: Role, tp: int, blocks: int) -> EndpointCfg:
    cfg = endpoint_cfg(
        role, layers=1, block_bytes=PAGE, num_blocks=blocks, verify=role != Role.DECODE
    )
    cfg["tp_size"] = tp
    cfg["pool"]["kv_heads"] = tp  # one head per rank: every rank's page is PAGE bytes
    return cfg


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    tps = QUICK_TPS if quick else FULL_TPS
    per_rank = (48 << 20) if quick else (384 << 20)
    rounds = 1 if quick else 3
    rep = Report(
        "tp",
        "tp: aggregate push bandwidth of N ranks (threads) vs N x one rank and N processes",
        quick,
        params={
            "page_bytes": PAGE,
            **PUSH_PARAMS,
            "bytes_per_rank_per_measurement": per_rank,
            "rounds": rounds,
            "tp_sizes": list(tps),
        },
    )
    req_bytes = BLOCKS * REGIONS * PAGE  # per rank
    n = max(INFLIGHT * 4, per_rank // req_bytes)
    p_blocks, d_blocks = BLOCKS * INFLIGHT * 4, BLOCKS * INFLIGHT * 2
    res: dict[int, dict[str, list[float]]] = {}
    with Cluster(logs_dir(out_dir, "tp")) as cl:
        for tp in tps:
            progress(f"tp: {tp} rank(s)")
            cfgs = {
                f"p-tp{tp}": _cfg(Role.PREFILL, tp, p_blocks),
                f"d-tp{tp}": _cfg(Role.DECODE, tp, d_blocks),
            }
            if tp > 1:
                for i in range(tp):
                    cfgs[f"p-proc{tp}-{i}"] = _cfg(Role.PREFILL, 1, p_blocks)
                    cfgs[f"d-proc{tp}-{i}"] = _cfg(Role.DECODE, 1, d_blocks)
            ws = cl.endpoints(cfgs)
            pairs = [(ws[f"p-tp{tp}"], ws[f"d-tp{tp}"])]
            procs = (
                [(ws[f"p-proc{tp}-{i}"], ws[f"d-proc{tp}-{i}"]) for i in range(tp)]
                if tp > 1
                else []
            )
            _push(pairs, "warm.", max(INFLIGHT * 2, n // 10))
            if procs:
                _push(procs, "warm.", max(INFLIGHT * 2, n // 10))
            e: dict[str, list[float]] = {"threads": [], "procs": [], "verified": [], "failed": []}
            for k in range(rounds):
                got = _push(pairs, f"r{k}.", n)
                e["threads"].append(got["bytes"] * tp / got["elapsed_s"] / 1e9)
                e["failed"].append(got["failed"])
                if procs:
                    pg = _push(procs, f"r{k}.", n)
                    e["procs"].append(pg["bytes"] / pg["elapsed_s"] / 1e9)
                    e["failed"].append(pg["failed"])
            e["verified"].append(_verified(*pairs[0], tp))
            res[tp] = e
            for w in ws.values():
                cl.stop(w)
    _report(rep, res, out_dir)
    return rep.to_dict()


class Pushed(TypedDict):
    """What every pair of a round pushed together (``_push``)."""

    bytes: int
    elapsed_s: float
    failed: int


def _push(pairs: list[tuple[Worker, Worker]], prefix: str, n: int) -> Pushed:
    """Every pair pushes ``n`` requests at once; bytes per rank summed over the pairs, elapsed
    the slowest pair's."""
    fps = [pw.call_async("finish_many", prefix=prefix, n=n, blocks=BLOCKS) for pw, _ in pairs]
    fds = [
        dw.call_async(
            "decode_many",
            reply=DecodeManyResult,
            p_addr=pw.address,
            prefix=prefix,
            n=n,
            blocks=BLOCKS,
            inflight=INFLIGHT,
        )
        for pw, dw in pairs
    ]
    reps = [f.result(900) for f in fds]
    for f in fps:
        f.result(60)
    ok = sum(sum(1 for x in r["ok"] if x) for r in reps)
    return {
        "bytes": ok * BLOCKS * REGIONS * PAGE,
        "elapsed_s": max(r["elapsed_s"] for r in reps),
        "failed": sum(sum(1 for x in r["ok"] if not x) for r in reps),
    }


def _verified(pw: Worker, dw: Worker, tp: int) -> float:
    """A verified pass at TP ``tp``: P writes every rank's heads, D checks every byte."""
    r = ClosedLoop(pw, dw, "v.", 16, BLOCKS, 4).verified()
    dw.call("set_verify", verify=False)
    return sum(1 for v in r["verified"] if v) / 16


def _report(rep: Report, res: dict[int, dict[str, list[float]]], out_dir: Path) -> None:
    base = median(res[1]["threads"])
    rows = []
    for tp, e in res.items():
        th = median(e["threads"])
        pr = median(e["procs"]) if e["procs"] else math.nan
        scale = ratio(th, tp * base)
        vs = ratio(th, pr) if e["procs"] else math.nan
        rows.append(
            [
                str(tp),
                fmt_num(th),
                fmt_num(tp * base),
                f"{scale * 100:.0f}%" if math.isfinite(scale) else "-",
                fmt_num(pr) if e["procs"] else "-",
                f"{vs * 100:.0f}%" if math.isfinite(vs) else "-",
                f"{e['verified'][0] * 100:.0f}%",
                str(int(math.fsum(e["failed"]))),
            ]
        )
        if tp > 1:
            rep.target(
                f"{tp} ranks as threads / {tp} ranks as processes",
                "report",
                f"{vs * 100:.0f}% ({fmt_num(th)} / {fmt_num(pr)} GB/s)",
                None,
            )
        if e["verified"][0] < 1 or any(e["failed"]):
            rep.target(f"content verified at TP {tp}", "all", "not all", False)
    rep.table(
        f"aggregate GB/s (median of rounds), {BLOCKS} blocks x {REGIONS} regions of "
        f"{PAGE >> 10} KiB per rank per request, {INFLIGHT} in flight per pair",
        [
            "ranks",
            "threads (TP N endpoints)",
            "N x one rank",
            "threads / N x one",
            "N processes (TP 1 pairs)",
            "threads / processes",
            "verified",
            "failed",
        ],
        rows,
        note="threads: one P and one D endpoint at TP N (kvpush's model: a rank is an agent, a "
        "pool and an owner thread in the endpoint's process). processes: N separate TP-1 P/D "
        "pairs at once (one process per rank). Same host, same rounds; timed without D's "
        "verification, then a verified pass at TP N.",
    )
    xs = list(res)
    series = [
        Series("TP N endpoints (threads)", [(x, median(res[x]["threads"])) for x in xs], "#1f77b4"),
        Series("N x one rank", [(x, x * base) for x in xs], "#7f7f7f", dash=True),
        Series(
            "N TP-1 pairs (processes)",
            [(x, median(res[x]["procs"])) for x in xs if res[x]["procs"]] or [(1, base)],
            "#d62728",
        ),
    ]
    panel = Panel(
        title="aggregate push bandwidth by TP size",
        series=series,
        xlabel="ranks",
        ylabel="GB/s",
        xticks=[(x, str(x)) for x in xs],
    )
    path = out_dir / "tp.svg"
    path.write_text(line_chart([panel], "tp: N ranks vs N x one rank"))
    rep.charts.append(str(path))
    rep.figures["tp"] = {str(k): v for k, v in res.items()}
