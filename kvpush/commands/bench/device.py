"""Scenario ``device``: pushes at model shapes between pools on a device, beside raw NIXL and
the device's own copy of the same bytes, in the same run (``kvpush bench device --device cuda``).

Per shape (``llama-8b``, ``llama-70b-tp8``) one P and one D endpoint process, their pools on
``--device`` (``cuda``: both on ``cuda:0``, VRAM registered with NIXL; ``cpu``: DRAM, the dry
run of ``scripts/gpu-check.sh``), and per request size, in the same rounds:

* **kvpush** push-only: D keeps ``inflight`` requests outstanding, P marks blocks finished as
  fast as its pool allows (``finish_many``), D's verification off in the timed part;
* **raw NIXL** VRAM->VRAM (DRAM->DRAM on the CPU) WRITE loop: a second agent in each endpoint
  process registering the same pool memory, replaying the (P ids, D ids) pairs kvpush's pass
  used (``raw.raw_pairs_loop``, merge on);
* **torch copy** of the same bytes inside P's process, one ``copy_`` per run of ids into a
  second pool-shaped buffer on the same device (``devcopy``): the device-to-device ceiling;
* a **verified** pass: P writes the transfer's pattern, D checks every byte (on the device).

Not in ``kvpush bench all`` (``bench model`` covers DRAM); run by ``scripts/gpu-check.sh``.
Threads: the caller's; the endpoints run in their worker processes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NotRequired, TypedDict

from kvpush.commands.bench.common import EndpointCfg, Progress, logs_dir
from kvpush.commands.bench.devcopy import DeviceCopyResult
from kvpush.commands.bench.model import _endpoint, _kvpush, _verified_pass, inflight_for
from kvpush.commands.bench.procs import Cluster, Worker
from kvpush.commands.bench.raw import RawLoopResult
from kvpush.commands.bench.raw_node import RawNodeInfo
from kvpush.commands.bench.report import Report, ResultDict, fmt_num, fmt_x
from kvpush.commands.bench.stats import median
from kvpush.config import Role
from kvpush.memory.pool import check_device
from kvpush.memory.shapes import SHAPES, Shape

SHAPE_NAMES = ("llama-8b", "llama-70b-tp8")
FULL_TOKENS = (2048, 8192)
QUICK_TOKENS = (512,)
FULL_POOL_BLOCKS = {"llama-8b": 2048, "llama-70b-tp8": 4096}  # 4.0 and 2.5 GiB per pool
QUICK_POOL_BLOCKS = 128
QUICK_LAYERS = 2
FULL_BUDGET = 4 << 30  # bytes per measurement
QUICK_BUDGET = 8 << 20
FULL_ROUNDS = 3


class DeviceCell(TypedDict):
    """One (shape, request size) cell: its rounds (``_shape``), then its medians (``_report``)."""

    shape: str
    tokens: int
    blocks: int
    request_bytes: int
    inflight: int
    requests: int
    kvpush_gbps: list[float]
    raw_gbps: list[float]
    copy_gbps: list[float]
    kvpush_failed: int
    verified: int
    verify_requests: int
    kvpush_median: NotRequired[float]
    raw_median: NotRequired[float]
    copy_median: NotRequired[float]


def _specs(shape: Shape, nb: int, device: str) -> dict[str, EndpointCfg]:
    out = {}
    for role in (Role.PREFILL, Role.DECODE):
        cfg = _endpoint(role, shape, nb)
        cfg["pool"]["device"] = device
        out[f"{role[0]}-{shape.name.replace('/', '-')}"] = cfg
    return out


def run(quick: bool, out_dir: Path, progress: Progress, device: str = "cpu") -> ResultDict:
    mem = check_device(device)  # a clear error before any process starts
    shapes = [SHAPES[n].with_layers(QUICK_LAYERS) if quick else SHAPES[n] for n in SHAPE_NAMES]
    tokens = QUICK_TOKENS if quick else FULL_TOKENS
    budget = QUICK_BUDGET if quick else FULL_BUDGET
    rounds = 1 if quick else FULL_ROUNDS
    rep = Report(
        "device",
        f"device: pushes between {mem} pools at model shapes vs raw NIXL {mem}->{mem} WRITE "
        "and a torch copy of the same bytes",
        quick,
        params={
            "device": device,
            "mem_type": mem,
            "shapes": [s.describe() for s in shapes],
            "tokens": list(tokens),
            "bytes_per_measurement": budget,
            "rounds": rounds,
        },
    )
    cells: list[DeviceCell] = []
    with Cluster(logs_dir(out_dir, "device")) as cl:
        for shape in shapes:
            nb = QUICK_POOL_BLOCKS if quick else FULL_POOL_BLOCKS[shape.name]
            progress(f"device: {shape.describe()}, {mem} pools of {nb} blocks")
            specs = _specs(shape, nb, device)
            ws = cl.endpoints(specs, timeout_s=180.0)
            pw, dw = (ws[k] for k in specs)
            try:
                cells.extend(_shape(pw, dw, shape, nb, tokens, budget, rounds, progress))
            finally:
                for w in (pw, dw):
                    w.call_async("stop")
                for w in (pw, dw):
                    cl.stop(w)
    _report(rep, cells, mem)
    return rep.to_dict()


def _shape(
    pw: Worker,
    dw: Worker,
    shape: Shape,
    nb: int,
    tokens: tuple[int, ...],
    budget: int,
    rounds: int,
    progress: Progress,
) -> list[DeviceCell]:
    target = dw.call(
        "raw_pool_node", reply=RawNodeInfo, poll="backoff", paused=True, call_timeout=300
    )
    pw.call("raw_pool_node", poll="none", paused=True, call_timeout=300)
    pw.call("raw_prepare", target=target, call_timeout=300)
    for w in (pw, dw):
        w.call("model_pool", kind="extent", call_timeout=60)
    _kvpush(pw, dw, f"{shape.name}.warm.", 4, shape, min(shape.blocks_for(tokens[0]), nb // 4), 2)
    cells: list[DeviceCell] = []
    for t in tokens:
        inflight = inflight_for(shape.request_bytes(t))
        blocks = min(shape.blocks_for(t), nb // inflight)  # what the pools hold in flight
        req_bytes = blocks * shape.block_bytes_all_regions
        n = max(3 * inflight, math.ceil(budget / req_bytes))
        kv: list[float] = []
        raw: list[float] = []
        copy: list[float] = []
        failed = 0
        for k in range(rounds):
            progress(f"device: {shape.name}, {t} tokens, round {k + 1}/{rounds}")
            r = _kvpush(pw, dw, f"{shape.name}.{t}.r{k}.", n, shape, blocks, inflight)
            kv.append(r["gbps"])
            failed += r["failed"]
            dw.call("raw_poll", on=True)
            try:
                rr = pw.call(
                    "raw_pairs_loop",
                    reply=RawLoopResult,
                    pairs=r["pairs"],
                    n=n,
                    inflight=inflight,
                    call_timeout=900,
                )
            finally:
                dw.call("raw_poll", on=False)
            raw.append(rr["gbps"])
            cp = pw.call(
                "device_copy_pairs", reply=DeviceCopyResult, pairs=r["pairs"], n=n, call_timeout=900
            )
            copy.append(cp["gbps"])
        verified, nv = _verified_pass(pw, dw, f"{shape.name}.{t}.v.", inflight, blocks)
        cells.append(
            {
                "shape": shape.name,
                "tokens": t,
                "blocks": blocks,
                "request_bytes": req_bytes,
                "inflight": inflight,
                "requests": n,
                "kvpush_gbps": kv,
                "raw_gbps": raw,
                "copy_gbps": copy,
                "kvpush_failed": failed,
                "verified": verified,
                "verify_requests": nv,
            }
        )
    pw.call("release_copy")
    for w in (pw, dw):
        w.call("raw_close")
    return cells


def _report(rep: Report, cells: list[DeviceCell], mem: str) -> None:
    rows = []
    for c in cells:
        kv, raw, cp = median(c["kvpush_gbps"]), median(c["raw_gbps"]), median(c["copy_gbps"])
        rows.append(
            [
                c["shape"],
                c["tokens"],
                f"{c['request_bytes'] / (1 << 20):.1f}",
                fmt_num(kv),
                fmt_num(raw),
                fmt_num(cp),
                fmt_x(kv / raw if raw else None),
                fmt_x(kv / cp if cp else None),
                f"{c['verified']}/{c['verify_requests']}",
            ]
        )
        c.update({"kvpush_median": kv, "raw_median": raw, "copy_median": cp})
    rep.table(
        f"push-only GB/s between {mem} pools (median of rounds)",
        [
            "shape",
            "tokens",
            "MiB/request",
            "kvpush",
            f"raw NIXL {mem}->{mem}",
            "torch copy",
            "kvpush/raw",
            "kvpush/copy",
            "verified",
        ],
        rows,
        note="GB/s count each byte once (a copy reads and writes it: the device moves twice "
        "that); 'verified': requests of the verified pass whose every byte D checked.",
    )
    ok = all(c["verified"] == c["verify_requests"] and c["kvpush_failed"] == 0 for c in cells)
    rep.target(
        "every byte verified at D, no push failed",
        "all",
        f"{sum(c['verified'] for c in cells)}/{sum(c['verify_requests'] for c in cells)}",
        ok,
    )
    ratios = [c["kvpush_median"] / c["raw_median"] for c in cells if c["raw_median"]]
    rep.target(
        "kvpush push-only vs raw NIXL, same bytes",
        "report",
        fmt_x(min(ratios)) + " (worst cell)" if ratios else "-",
        None,
    )
    rep.figures["cells"] = cells
