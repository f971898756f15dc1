"""Scenario ``rate``: small pushes per second beside a raw pipelined NIXL WRITE+notif loop.

One block of 16 KiB per region, 1 layer (2 regions): a push is 2 descriptors, 32 KiB, plus
kvpush's completion notification. kvpush: D keeps ``inflight`` requests outstanding
(``decode_many``), P marks blocks finished as fast as its pool allows (``finish_many``, no
pattern write), D's verification off while timed, then a verified pass. Raw: the same
descriptors and pool sizes, WRITE + a short notification, the same number in flight, progress
threads off, the target polling. Rounds alternate raw / kvpush.

Coalescing A/B (issue 30): a second P/D pair runs with ``coalesce=False`` (one WRITE and one
``Completion`` per push, as before coalescing), in the same rounds, its turn alternating with
the default pair's; one run shows coalescing on vs off vs raw NIXL.

CPU per push comes from the kernel's per-thread accounting (``/proc/self/task/*/schedstat``):
P's writer thread, and the raw initiator's loop thread. *Writer overhead per push* is the
difference: what kvpush's writer spends beyond the NIXL calls a bare loop makes. The full run
also drives a second P/D pair whose D has ``busy_spin_us=0``, in the same rounds. The tables,
targets and notes are ``kvpush.commands.bench.rate_report``.

Floors (issue 30): the first configuration's rounds also time raw NIXL notifications sent back
to back (``raw_notifs``) and count kvpush's notifications each way (each side's
``notifs_received``); after them UCX's own message rates run (``ucx_floors``: ``ucx_perftest``,
when installed). ``rate_floors`` sets them in one table.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvpush.commands.bench import ucx_floors
from kvpush.commands.bench.common import EndpointCfg, Progress, endpoint_cfg, logs_dir
from kvpush.commands.bench.passes import ClosedLoop, raw_pair
from kvpush.commands.bench.probes import StatsReply
from kvpush.commands.bench.procs import BenchError, Cluster, Worker
from kvpush.commands.bench.rate_floors import floors_report
from kvpush.commands.bench.rate_report import InflightRounds, KvRound, report
from kvpush.commands.bench.raw import RawLoopResult
from kvpush.commands.bench.raw_node import RawNodeInfo
from kvpush.commands.bench.raw_notifs import RawNotifResult
from kvpush.commands.bench.report import Report, ResultDict
from kvpush.commands.bench.stats import ratio, summary
from kvpush.commands.bench.ucx_floors import Floor
from kvpush.config import Role

BLOCK_BYTES = 16 << 10
REGIONS = 2
P_BLOCKS = 1024
D_BLOCKS = 256


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    configs = ((64, 2000), (1, 300)) if quick else ((64, 20000), (1, 3000))
    rounds = 1 if quick else 3
    rep = Report(
        "rate",
        "rate: 1-block pushes per second vs a raw pipelined NIXL WRITE+notif loop",
        quick,
        params={
            "block_bytes": BLOCK_BYTES,
            "regions": REGIONS,
            "blocks_per_request": 1,
            "configs": [list(c) for c in configs],
            "rounds": rounds,
            "p_pool_blocks": P_BLOCKS,
            "d_pool_blocks": D_BLOCKS,
        },
    )
    out: dict[int, InflightRounds] = {}
    with Cluster(logs_dir(out_dir, "rate")) as cl:
        progress("rate: starting P, D and the raw workers")
        ws = _endpoints(cl, quick)
        pw, dw = ws["p"], ws["d"]
        sw, sd = ws["p-single"], ws["d-single"]
        nospin = "p-nospin" in ws
        rt, ri = cl.spawn("raw-target"), cl.spawn("raw-initiator")
        rt.wait_started()
        ri.wait_started()
        _kvpush(pw, dw, "warm.", 1000 if not quick else 300, 64)
        _kvpush(sw, sd, "warm.", 1000 if not quick else 300, 64)
        if nospin:
            _kvpush(ws["p-nospin"], ws["d-nospin"], "warm.", 1000, 64)
        notifs: list[RawNotifResult] = []
        notif_notes: list[str] = []
        floors: tuple[list[Floor], list[str]] = ([], [])
        for inflight, n in configs:
            progress(f"rate: {inflight} in flight")
            kv: list[KvRound] = []
            raw: list[RawLoopResult] = []
            kv_ns: list[KvRound] = []
            kv_single: list[KvRound] = []
            for k in range(rounds):
                raw.append(_raw_round(rt, ri, n, inflight))
                if k % 2:  # coalescing off first in odd rounds: neither always goes first
                    kv_single.append(_kvpush(sw, sd, f"k{inflight}.r{k}.", n, inflight))
                kv.append(_kvpush(pw, dw, f"k{inflight}.r{k}.", n, inflight))
                if not k % 2:
                    kv_single.append(_kvpush(sw, sd, f"k{inflight}.r{k}.", n, inflight))
                if nospin and inflight > 1:
                    kv_ns.append(
                        _kvpush(ws["p-nospin"], ws["d-nospin"], f"k{inflight}.r{k}.", n, inflight)
                    )
                if inflight == configs[0][0]:
                    try:
                        notifs.append(_raw_notif_round(rt, ri, n))
                    except BenchError as e:  # a floor lost is a note, not a lost bench
                        notif_notes.append(f"raw NIXL notifications, round {k + 1}: {e}")
            out[inflight] = {
                "n": n,
                "kvpush": kv,
                "raw": raw,
                "kvpush_d_nospin": kv_ns,
                "kvpush_single": kv_single,
            }
            if inflight == configs[0][0]:
                hist = pw.call("stats", reply=StatsReply)["histograms"]
                out[inflight]["p_hist"] = {
                    h: hist.get(h) for h in ("push_latency", "write_duration")
                }
                out[inflight]["raw_notifs"] = notifs
                progress("rate: UCX's own floors (ucx_perftest)")
                floors = ucx_floors.measure(quick)
        progress("rate: verified pass")
        verified = _verified_pass(pw, dw, 64)
    report(rep, out, verified, 64)
    ucx, ucx_notes = floors
    floors_report(
        rep, out[configs[0][0]], configs[0][0], ucx, notif_notes + ucx_notes, ucx_floors.version()
    )
    return rep.to_dict()


def _endpoints(cl: Cluster, quick: bool) -> dict[str, Worker]:
    """P and D (D does not verify: timed parts), a pair with coalescing off (the A/B), and, in a
    full run, a pair whose D does not keep polling after activity (busy_spin_us=0)."""
    nospin: dict[str, EndpointCfg] = {}
    if not quick:
        dcfg = endpoint_cfg(
            Role.DECODE, layers=1, block_bytes=BLOCK_BYTES, num_blocks=D_BLOCKS, verify=False
        )
        dcfg["agent"]["busy_spin_us"] = 0
        nospin = {
            "p-nospin": endpoint_cfg(
                Role.PREFILL, layers=1, block_bytes=BLOCK_BYTES, num_blocks=P_BLOCKS
            ),
            "d-nospin": dcfg,
        }
    single = {
        "p-single": {**p_cfg(), "coalesce": False},
        "d-single": {**d_cfg(), "coalesce": False},
    }
    return cl.endpoints({**nospin, **single, "p": p_cfg(), "d": d_cfg()})


def p_cfg() -> EndpointCfg:
    return endpoint_cfg(Role.PREFILL, layers=1, block_bytes=BLOCK_BYTES, num_blocks=P_BLOCKS)


def d_cfg() -> EndpointCfg:
    return endpoint_cfg(
        Role.DECODE, layers=1, block_bytes=BLOCK_BYTES, num_blocks=D_BLOCKS, verify=False
    )


def _raw_round(rt: Worker, ri: Worker, n: int, inflight: int) -> RawLoopResult:
    """One round of the raw pipelined WRITE+notif loop between fresh raw nodes."""
    ti = raw_pair(rt, ri, REGIONS, D_BLOCKS, P_BLOCKS, BLOCK_BYTES)
    r = ri.call(
        "raw_write_loop",
        reply=RawLoopResult,
        target=ti,
        blocks=1,
        n=n,
        inflight=inflight,
        notif=True,
        call_timeout=600,
    )
    ri.call("raw_close")
    rt.call("raw_close")
    return r


def _raw_notif_round(rt: Worker, ri: Worker, n: int) -> RawNotifResult:
    """One round of raw NIXL notifications, back to back, between fresh raw nodes (a page of
    registered memory each: notifications need none)."""
    shape = {"regions": 1, "num_blocks": 1, "block_bytes": 4096}
    ti = rt.call("raw_node", reply=RawNodeInfo, poll="spin", **shape)
    ii = ri.call("raw_node", reply=RawNodeInfo, poll="none", **shape)
    warmup = 200
    try:
        rt.call("raw_notif_target", initiator=ii, expect=[warmup, n])
        return ri.call(
            "raw_notif_loop", reply=RawNotifResult, target=ti, n=n, warmup=warmup, call_timeout=300
        )
    finally:
        ri.call("raw_close")
        rt.call("raw_close")


def _verified_pass(pw: Worker, dw: Worker, n: int) -> int:
    """``n`` pushes written with the pattern and checked byte by byte on D: how many passed."""
    v = ClosedLoop(pw, dw, "verify.", n, 1, n).verified(call_timeout=300)
    return sum(1 for x in v["verified"] if x is True)


def _kvpush(pw: Worker, dw: Worker, prefix: str, n: int, inflight: int) -> KvRound:
    p0, d0 = pw.call("stats", reply=StatsReply), dw.call("stats", reply=StatsReply)
    r, c0, c1 = ClosedLoop(pw, dw, prefix, n, 1, inflight).timed()
    p1, d1 = pw.call("stats", reply=StatsReply), dw.call("stats", reply=StatsReply)
    w0, w1 = _writes(p0), _writes(p1)
    ok = sum(1 for x in r["ok"] if x)
    lat = [x for x, g in zip(r["latency_s"], r["ok"], strict=True) if g]
    return {
        "per_s": ok / r["elapsed_s"],
        "failed": n - ok,
        "latency": summary(lat),
        "writer_cpu_us": (c1.get("push-writer", 0.0) - c0.get("push-writer", 0.0))
        / max(1, ok)
        * 1e6,
        "p_cpu_us": (c1["process"] - c0["process"]) / max(1, ok) * 1e6,
        "d_cpu_us": r["cpu_s"] / max(1, ok) * 1e6,
        "d_receiver_cpu_us": r["threads_cpu_s"].get("decode-receiver", 0.0) / max(1, ok) * 1e6,
        "d_client_cpu_us": r["threads_cpu_s"].get("client", math.nan) / max(1, ok) * 1e6,
        # P's WRITEs posted meanwhile (its lane figures count posts) and pushes per WRITE
        "writes": w1[0] - w0[0],
        "pushes_per_write": ratio(w1[1] - w0[1], w1[0] - w0[0]),
        "post_us_per_desc": w1[2],
        # notifications each side received meanwhile: D -> P (PUSH_REG batches), P -> D
        "d_to_p_notifs": _notifs(p1) - _notifs(p0),
        "p_to_d_notifs": _notifs(d1) - _notifs(d0),
        "elapsed_s": r["elapsed_s"],
    }


def _notifs(snap: StatsReply) -> int:
    return int((snap.get("counters") or {}).get("notifs_received", 0))


def _writes(snap: StatsReply) -> tuple[int, int, float]:
    """P's WRITEs posted so far (every D rank's), pushes ended ok, and the latest mean post
    time per descriptor (us) of its busiest peer (``kvpush.prefill.lanestats``)."""
    writes, per_desc, most = 0, math.nan, -1
    for row in snap.get("peers") or []:
        lane = row.get("lane") if isinstance(row, dict) else None
        if isinstance(lane, dict) and isinstance(lane.get("pushes"), int):
            writes += lane["pushes"]
            if lane["pushes"] > most and lane.get("post_us_per_desc") is not None:
                most, per_desc = lane["pushes"], float(lane["post_us_per_desc"])
    return writes, int((snap.get("counters") or {}).get("pushes_ok", 0)), per_desc
