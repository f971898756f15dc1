"""Scenario ``bandwidth``: end-to-end push GB/s beside a raw NIXL WRITE loop and the host's limits.

Per block size: a P and a D process (1 layer = 2 regions, ``BLOCKS`` blocks per request, so a
push is ``BLOCKS x 2`` descriptors), and two raw workers. Rounds alternate raw / kvpush so that
a noisy neighbour hurts both alike; the median of the rounds is reported.

* **kvpush**: D keeps ``INFLIGHT`` requests outstanding (``decode_many``); P marks blocks
  finished as fast as its pool allows (``finish_many``, no pattern write: a model would have
  computed the KV). Timed with D's verification off; afterwards a verified pass (P writes the
  pattern, D checks every byte) must come back fully verified.
* **raw NIXL**: the same descriptor shape and pool sizes, WRITE + a short notification,
  ``INFLIGHT`` outstanding, best configuration found here: progress thread off on both agents,
  the target polling ``get_new_notifs`` back to back (``raw_node.RawNode``).
* **process_vm_writev** (the syscall UCX's CMA transport uses) with one iovec per descriptor, and
  single-threaded **memcpy** of the same shape: the machine's limits.
* At 256 KiB (full run): kvpush and raw NIXL again with NIXL's progress thread *on*.
* At 256 KiB and 1 MiB (full run): a second kvpush pair whose D has ``busy_spin_us=0`` (its
  receiver sleeps as soon as it is idle instead of polling on for 2 ms), in the same rounds.

This module owns the parameters and the measurement (``run``, ``_size``); the tables, targets and
chart are ``kvpush.commands.bench.bandwidth_report``. Runs in the orchestrator process, on the
thread that runs the scenario; the endpoints and the raw loops run in the workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from kvpush.commands.bench.bandwidth_report import SizeResult, kib, report
from kvpush.commands.bench.common import EndpointCfg, Progress, endpoint_cfg, logs_dir
from kvpush.commands.bench.host_limits import CopyResult
from kvpush.commands.bench.passes import ClosedLoop, raw_pair
from kvpush.commands.bench.probes import StatsReply, histogram
from kvpush.commands.bench.procs import Cluster, Worker
from kvpush.commands.bench.raw import RawLoopResult
from kvpush.commands.bench.report import Report, ResultDict
from kvpush.config import Role

BLOCKS = 4
INFLIGHT = 8
REGIONS = 2  # layers=1
#: The push geometry as a scenario's parameters report it (``tp`` pushes with the same one).
PUSH_PARAMS = {"blocks_per_request": BLOCKS, "regions": REGIONS, "inflight": INFLIGHT}
P_POOL_BYTES = 256 << 20
FULL_SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
QUICK_SIZES = (256 << 10,)
PT_SIZE = 256 << 10
#: Sizes at which a second kvpush pair runs with D's ``busy_spin_us`` = 0 (no spinning with
#: ``sleep(0)`` after activity, which holds on to the GIL): same rounds, same raw baseline.
NOSPIN_SIZES = (256 << 10, 1 << 20)


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    sizes = QUICK_SIZES if quick else FULL_SIZES
    total = (64 << 20) if quick else (1536 << 20)
    rounds = 1 if quick else 5
    rep = Report(
        "bandwidth",
        "bandwidth: end-to-end pushes vs raw NIXL WRITE, process_vm_writev and memcpy",
        quick,
        params={
            "block_sizes": list(sizes),
            **PUSH_PARAMS,
            "bytes_per_measurement": total,
            "rounds": rounds,
        },
    )
    res: list[SizeResult] = []
    with Cluster(logs_dir(out_dir, "bandwidth")) as cl:
        rt, ri = cl.spawn("raw-target"), cl.spawn("raw-initiator")
        rt.wait_started()
        ri.wait_started()
        for bs in sizes:
            progress(f"bandwidth: {kib(bs)} blocks")
            res.append(
                _size(
                    cl,
                    rt,
                    ri,
                    bs,
                    total,
                    rounds,
                    progress_thread=False,
                    nospin=not quick and bs in NOSPIN_SIZES,
                )
            )
        if not quick:
            progress(f"bandwidth: {kib(PT_SIZE)} blocks with NIXL's progress thread on")
            pt = _size(cl, rt, ri, PT_SIZE, total, 2, progress_thread=True)
    report(rep, res, None if quick else pt, out_dir)
    return rep.to_dict()


def _geometry(bs: int) -> tuple[int, int, int]:
    req_blocks = BLOCKS
    p_blocks = max(req_blocks * INFLIGHT * 2, P_POOL_BYTES // (REGIONS * bs))
    d_blocks = req_blocks * INFLIGHT * 2
    return req_blocks, p_blocks, d_blocks


def _size(
    cl: Cluster,
    rt: Worker,
    ri: Worker,
    bs: int,
    total: int,
    rounds: int,
    *,
    progress_thread: bool,
    nospin: bool = False,
) -> SizeResult:
    blocks, p_blocks, d_blocks = _geometry(bs)
    req_bytes = blocks * REGIONS * bs
    n = max(INFLIGHT * 4, total // req_bytes)
    tag = f"{bs >> 10}k" + ("-pt" if progress_thread else "")
    ws = _endpoints(cl, tag, bs, p_blocks, d_blocks, progress_thread, nospin)
    pw, dw = ws[f"p-{tag}"], ws[f"d-{tag}"]
    kv: list[KvRound] = []
    kv_nospin: list[KvRound] = []
    if nospin:
        _kvpush(
            ws[f"p-{tag}-nospin"],
            ws[f"d-{tag}-nospin"],
            "warm.",
            max(INFLIGHT * 2, n // 10),
            blocks,
            bs,
        )
    raw: list[RawLoopResult] = []
    pvw: list[float] = []
    mem: list[float] = []
    _kvpush(pw, dw, "warm.", max(INFLIGHT * 2, n // 10), blocks, bs)
    for k in range(rounds):
        raw.append(_raw_round(rt, ri, bs, blocks, n, progress_thread, pvw, mem if k == 0 else None))
        kv.append(_kvpush(pw, dw, f"r{k}.", n, blocks, bs))
        if nospin:
            kv_nospin.append(
                _kvpush(ws[f"p-{tag}-nospin"], ws[f"d-{tag}-nospin"], f"r{k}.", n, blocks, bs)
            )
    # Verified pass: P writes the pattern, D checks every byte of every block.
    nv = 4
    v = ClosedLoop(pw, dw, "verify.", nv, blocks, nv).verified(call_timeout=300)
    verified = sum(1 for x in v["verified"] if x is True)
    for w in ws.values():
        cl.stop(w)
    return {
        "block_bytes": bs,
        "blocks": blocks,
        "requests": n,
        "request_bytes": req_bytes,
        "progress_thread": progress_thread,
        "kvpush_gbps": [x["gbps"] for x in kv],
        "kvpush_failed": sum(x["failed"] for x in kv),
        "kvpush_p_cpu": [x["p_cpu_frac"] for x in kv],
        "kvpush_writer_cpu": [x["writer_cpu_frac"] for x in kv],
        "kvpush_d_cpu": [x["d_cpu_frac"] for x in kv],
        "kvpush_in_write": [x["in_write_frac"] for x in kv],
        "kvpush_d_nospin_gbps": [x["gbps"] for x in kv_nospin],
        "kvpush_d_nospin_d_cpu": [x["d_cpu_frac"] for x in kv_nospin],
        "raw_gbps": [x["gbps"] for x in raw],
        "pvw_gbps": pvw,
        "memcpy_gbps": mem,
        "verified": verified,
        "verify_requests": nv,
    }


def _endpoints(
    cl: Cluster,
    tag: str,
    bs: int,
    p_blocks: int,
    d_blocks: int,
    progress_thread: bool,
    nospin: bool,
) -> dict[str, Worker]:
    """P and D for one block size (D does not verify: timed parts), and with ``nospin`` a
    second pair whose D does not keep polling after activity (busy_spin_us=0)."""

    def pair(spin: bool) -> tuple[EndpointCfg, EndpointCfg]:
        pt = spin and progress_thread  # the default (off) for the pair without spin
        p = endpoint_cfg(
            Role.PREFILL, num_blocks=p_blocks, layers=1, block_bytes=bs, progress_thread=pt
        )
        d = endpoint_cfg(
            Role.DECODE,
            num_blocks=d_blocks,
            verify=False,
            layers=1,
            block_bytes=bs,
            progress_thread=pt,
        )
        if not spin:
            d["agent"]["busy_spin_us"] = 0
        return p, d

    cfgs: dict[str, EndpointCfg] = {}
    if nospin:
        cfgs[f"p-{tag}-nospin"], cfgs[f"d-{tag}-nospin"] = pair(spin=False)
    cfgs[f"p-{tag}"], cfgs[f"d-{tag}"] = pair(spin=True)
    return cl.endpoints(cfgs)


def _raw_round(
    rt: Worker,
    ri: Worker,
    bs: int,
    blocks: int,
    n: int,
    progress_thread: bool,
    pvw: list[float],
    mem: list[float] | None,
) -> RawLoopResult:
    """One round of the baselines between fresh raw nodes: the pipelined NIXL WRITE+notif loop
    (returned) and, without a progress thread, ``process_vm_writev`` (appended to ``pvw``) and
    a memcpy (appended to ``mem`` when given)."""
    _, p_blocks, d_blocks = _geometry(bs)
    ti = raw_pair(rt, ri, REGIONS, d_blocks, p_blocks, bs, progress_thread=progress_thread)
    same = {"blocks": blocks, "n": n, "call_timeout": 600}  # every baseline moves the same bytes
    raw = ri.call(
        "raw_write_loop", reply=RawLoopResult, target=ti, inflight=INFLIGHT, notif=True, **same
    )
    if not progress_thread:
        pvw.append(ri.call("pvw_loop", reply=CopyResult, target=ti, **same)["gbps"])
    ri.call("raw_close")
    rt.call("raw_close")
    if not progress_thread and mem is not None:
        memcpy = ri.call(
            "memcpy_loop",
            reply=CopyResult,
            regions=REGIONS,
            num_blocks=p_blocks,
            block_bytes=bs,
            **same,
        )
        mem.append(memcpy["gbps"])
    return raw


class KvRound(TypedDict):
    """One timed kvpush round (``_kvpush``): GB/s and CPU as shares of its elapsed time."""

    gbps: float
    in_write_frac: float
    failed: int
    p_cpu_frac: float
    writer_cpu_frac: float
    d_cpu_frac: float


def _kvpush(pw: Worker, dw: Worker, prefix: str, n: int, blocks: int, bs: int) -> KvRound:
    w0 = _write_time(pw)
    r, c0, c1 = ClosedLoop(pw, dw, prefix, n, blocks, INFLIGHT).timed()
    w1 = _write_time(pw)
    el = r["elapsed_s"]
    nbytes = sum(1 for x in r["ok"] if x) * blocks * REGIONS * bs
    return {
        "gbps": nbytes / el / 1e9,
        # share of the timed part P's WRITEs were in progress (post -> complete, summed)
        "in_write_frac": (w1 - w0) / el,
        "failed": sum(1 for x in r["ok"] if not x),
        "p_cpu_frac": (c1["process"] - c0["process"]) / el,
        "writer_cpu_frac": (c1.get("push-writer", 0.0) - c0.get("push-writer", 0.0)) / el,
        "d_cpu_frac": r["cpu_s"] / el,
    }


def _write_time(pw: Worker) -> float:
    raw = pw.call("stats", reply=StatsReply)["histograms"].get("write_duration")
    return histogram(raw).sum if raw else 0.0
