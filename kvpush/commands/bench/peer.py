"""Scenario ``peer`` (``kvpush bench peer``, not part of ``all``: it needs the vLLM virtualenv):
kvpush P -> kvpush D beside vLLM P -> vLLM D with vLLM 0.33's own ``NixlPushConnector``, at the
same geometry on the same NIXL, measured in one run with the order alternated.

Processes: a kvpush P and D (bench workers, ``kvpush.commands.bench.procs``) and a vLLM P and D
(``kvpush.commands.bench.peer_vllm.driver`` in the vLLM virtualenv, through
``kvpush.commands.bench.peer_vllm.pair``), all started here and stopped when the scenario ends,
however it ends. Geometry and cells: ``kvpush.commands.bench.peer_plan`` (per-layer regions,
blocks of 16 tokens; requests of 1, 16 and 256 blocks at 1 and 16 in flight). After a warm-up
on each pair (handshakes, and every D block written once), each round runs every cell on both
systems, the first system alternating from cell to cell and round to round; vLLM's processes are
stopped (SIGSTOP) except while their own cells run (``pair``'s docstring says why). One cell on
one system is a closed loop: D keeps ``inflight`` requests registered, P finishes them ahead
without writing bytes. Report: ``kvpush.commands.bench.peer_report``.

``run_peer`` is what the command calls: the result as text or one JSON line, and
``<out>/peer.json``. Runs on the caller's thread; everything else is a child process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvpush.commands.bench.common import EndpointCfg, Progress, endpoint_cfg, logs_dir
from kvpush.commands.bench.passes import ClosedLoop
from kvpush.commands.bench.peer_plan import Cell, PeerPlan
from kvpush.commands.bench.peer_report import SYSTEMS, Round, report
from kvpush.commands.bench.peer_vllm.pair import VllmPair, vllm_python
from kvpush.commands.bench.procs import Cluster, Worker
from kvpush.commands.bench.report import Report, ResultDict
from kvpush.config import Role

ROUND_TIMEOUT_S = 300.0
RESUME_SETTLE_S = 0.3  # after SIGCONT, before the round: both processes running again
WARM_SMALL = 20  # 1-block requests, 1 in flight: the handshakes


def _kvpush_cfg(role: Role, plan: PeerPlan, num_blocks: int) -> EndpointCfg:
    g = plan.geometry
    cfg = endpoint_cfg(
        role, layers=g.layers, block_bytes=g.block_bytes, num_blocks=num_blocks,
        verify=role != Role.DECODE,
    )  # fmt: skip
    cfg["pool"].update({"kv_regions": "per-layer", "kv_heads": g.kv_heads, "dtype": g.dtype})
    return cfg


def _kvpush_round(pw: Worker, dw: Worker, prefix: str, c: Cell) -> dict[str, object]:
    r, c0, c1 = ClosedLoop(pw, dw, prefix, c.n, c.blocks, c.inflight).timed()
    ok = [bool(x) for x in r["ok"]]
    return {
        "ok": sum(ok),
        "failed": c.n - sum(ok),
        "elapsed_s": r["elapsed_s"],
        "latency_s": [x for x, g in zip(r["latency_s"], ok, strict=True) if g],
        "p_cpu_s": c1["process"] - c0["process"],
        "d_cpu_s": r["cpu_s"],
    }


def _vllm_round(vp: VllmPair, prefix: str, c: Cell) -> dict[str, object]:
    vp.resume()
    time.sleep(RESUME_SETTLE_S)
    try:
        r = vp.round(prefix, c.blocks, c.inflight, c.n, ROUND_TIMEOUT_S)
    finally:
        vp.pause()
    return {k: r.get(k) for k in ("ok", "failed", "elapsed_s", "latency_s", "p_cpu_s")} | {
        "d_cpu_s": r.get("cpu_s")
    }


def _warm_up(pw: Worker, dw: Worker, vp: VllmPair, plan: PeerPlan) -> None:
    """Handshakes, then every D block written once (first-touch faults out of the rounds)."""
    big = max(plan.cells, key=lambda c: (c.blocks, c.inflight))
    steps = (Cell(1, 1, WARM_SMALL), Cell(big.blocks, big.inflight, plan.d_blocks // big.blocks))
    for k, c in enumerate(steps):
        _kvpush_round(pw, dw, f"warm{k}.", c)
        _vllm_round(vp, f"warm{k}.", c)


def _rounds(
    pw: Worker, dw: Worker, vp: VllmPair, plan: PeerPlan, progress: Progress
) -> dict[str, dict[str, list[Round]]]:
    samples: dict[str, dict[str, list[Round]]] = {
        c.key: {s: [] for s in SYSTEMS} for c in plan.cells
    }
    for k in range(plan.rounds):
        progress(f"peer: round {k + 1}/{plan.rounds}")
        for j, c in enumerate(plan.cells):
            order = SYSTEMS if (k + j) % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                prefix = f"{system[0]}{c.key}.r{k}."
                got = (
                    _kvpush_round(pw, dw, prefix, c)
                    if system == "kvpush"
                    else _vllm_round(vp, prefix, c)
                )
                samples[c.key][system].append(got)
    return samples


def run(
    quick: bool,
    out_dir: Path,
    progress: Progress,
    vllm_py: str | None = None,
    requests: int | None = None,
    rounds: int | None = None,
) -> ResultDict:
    python = vllm_python(vllm_py)  # before anything starts: a clear error, nothing to stop
    plan = PeerPlan.make(quick, requests, rounds)
    rep = Report(
        "peer",
        "peer: kvpush P -> kvpush D beside vLLM P -> vLLM D (vLLM's own NixlPushConnector)",
        quick,
        params={
            "geometry": {**plan.geometry.__dict__, "block_bytes": plan.geometry.block_bytes},
            "cells": [c.__dict__ for c in plan.cells],
            "rounds": plan.rounds,
            "requests": plan.requests,
            "d_pool_blocks": plan.d_blocks,
            "p_pool_blocks": plan.p_blocks,
            "vllm_python": python,
        },
    )
    run_dir = logs_dir(out_dir, "peer")
    with Cluster(run_dir) as cl, VllmPair(python, plan, run_dir) as vp:
        progress(
            "peer: starting vLLM P and D (importing vLLM takes about a minute) and kvpush P and D"
        )
        vp.launch()
        ws = cl.endpoints(
            {
                "p": _kvpush_cfg(Role.PREFILL, plan, plan.p_blocks),
                "d": _kvpush_cfg(Role.DECODE, plan, plan.d_blocks),
            }
        )
        vp.wait_ready()
        vp.pause()
        rep.params["vllm_version"] = vp.p_info.get("vllm_version")
        progress("peer: warm-up")
        _warm_up(ws["p"], ws["d"], vp, plan)
        samples = _rounds(ws["p"], ws["d"], vp, plan, progress)
    rep.data["rounds"] = samples
    report(rep, plan, samples)
    return rep.to_dict()


def run_peer(
    quick: bool,
    json_out: bool,
    out_dir: Path | None,
    vllm_py: str | None,
    requests: int | None,
    rounds: int | None,
) -> None:
    """``kvpush bench peer``: run the scenario, print it, write ``<out>/peer.json``."""
    from kvpush.commands.bench import DEFAULT_OUT_DIR
    from kvpush.commands.bench.noise import HostMonitor
    from kvpush.commands.bench.render import render_text

    out = out_dir if out_dir is not None else DEFAULT_OUT_DIR
    vllm_python(vllm_py)  # a missing vLLM python is a usage error: before the output directory
    out.mkdir(parents=True, exist_ok=True)
    monitor = HostMonitor().start()
    try:
        result = run(
            quick, out, lambda m: print(m, file=sys.stderr, flush=True), vllm_py, requests, rounds
        )
    finally:
        noise = monitor.stop()
    result["host_noise"] = noise
    (out / "peer.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if json_out else render_text(result), flush=True)
