"""The report of ``kvpush bench peer``: per cell (blocks per request x requests in flight)
kvpush beside vLLM's own connector -- requests/s and their ratio, latency p50/p99, CPU per
request on P and on D -- plus the figures, one target per cell and what each figure includes.

A pure function of the plan and the rounds' samples (``report``); no I/O. Runs in the
orchestrator, on the scenario's thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from kvpush.commands.bench.peer_plan import PeerPlan
from kvpush.commands.bench.report import Report, fmt_ms, fmt_num, fmt_x
from kvpush.commands.bench.stats import median, percentile, ratio

#: One system's round of one cell: ``ok``, ``failed``, ``elapsed_s``, ``latency_s`` (the ok
#: requests'), ``p_cpu_s``, ``d_cpu_s``.
Round = Mapping[str, object]
SYSTEMS = ("kvpush", "vllm")

COLUMNS = [
    "blocks", "in flight", "kvpush req/s", "vLLM req/s", "kvpush/vLLM",
    "kvpush p50 ms", "vLLM p50 ms", "kvpush p99 ms", "vLLM p99 ms",
    "kvpush P us", "vLLM P us", "kvpush D us", "vLLM D us",
]  # fmt: skip

VLLM_INCLUDES = (
    "vLLM = vLLM 0.33's own NixlPushConnector, its scheduler-side and worker-side halves in one "
    "process per side, driven by kvpush's driver (peer_vllm/driver.py) the way an engine calls "
    "them (on_new_request, get_num_new_matched_tokens, update_state_after_alloc, "
    "request_finished; build_connector_meta -> bind_connector_metadata -> start_load_kv -> "
    "get_transfer_results -> update_connector_output per step), a step every ~1 ms while "
    "requests are in flight; no model forward, no real scheduler or block manager (the driver "
    "hands out block ids), and the vLLM Request objects the driver builds are part of its CPU"
)
KVPUSH_INCLUDES = (
    "kvpush = kvpush P and D endpoint processes (bench workers): D keeps the requests in flight "
    "(decode), P marks blocks finished as its pool allows (finish, no bytes written); D does not "
    "verify in the timed rounds"
)


def num(x: object) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan


def rate(r: Round) -> float:
    e = num(r.get("elapsed_s"))
    return num(r.get("ok")) / e if e > 0 else math.nan


def per_request_us(r: Round, key: str) -> float:
    ok = num(r.get("ok"))
    return num(r.get(key)) / ok * 1e6 if ok > 0 else math.nan


def latencies(rounds: Sequence[Round]) -> list[float]:
    out: list[float] = []
    for r in rounds:
        lat = r.get("latency_s")
        if isinstance(lat, list):
            out.extend(float(x) for x in lat)
    return out


def summarize(rounds: Sequence[Round]) -> dict[str, float]:
    """One system's cell: the median round's rate and CPU, latency over every round's requests."""
    lat = latencies(rounds)
    return {
        "per_s": median([rate(r) for r in rounds]),
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "p_cpu_us": median([per_request_us(r, "p_cpu_s") for r in rounds]),
        "d_cpu_us": median([per_request_us(r, "d_cpu_s") for r in rounds]),
        "failed": sum(num(r.get("failed")) for r in rounds),
        "requests": sum(num(r.get("ok")) for r in rounds),
    }


def report(
    rep: Report, plan: PeerPlan, samples: Mapping[str, Mapping[str, Sequence[Round]]]
) -> None:
    """Fill ``rep`` from ``samples``: cell key -> system (``kvpush``/``vllm``) -> rounds."""
    rows = []
    for c in plan.cells:
        kv, vl = (summarize(samples.get(c.key, {}).get(s, ())) for s in SYSTEMS)
        r = ratio(kv["per_s"], vl["per_s"])
        rows.append([
            str(c.blocks), str(c.inflight), fmt_num(kv["per_s"], 0), fmt_num(vl["per_s"], 0),
            fmt_x(r), fmt_ms(kv["p50_s"]), fmt_ms(vl["p50_s"]), fmt_ms(kv["p99_s"]),
            fmt_ms(vl["p99_s"]), fmt_num(kv["p_cpu_us"], 0), fmt_num(vl["p_cpu_us"], 0),
            fmt_num(kv["d_cpu_us"], 0), fmt_num(vl["d_cpu_us"], 0),
        ])  # fmt: skip
        rep.figures[c.key] = {"blocks": c.blocks, "inflight": c.inflight, "requests": c.n,
                              "kvpush": kv, "vllm": vl, "ratio": r}  # fmt: skip
        failed = int(kv["failed"] + vl["failed"])
        rep.target(
            f"kvpush / vLLM requests/s, {c.blocks} block(s), {c.inflight} in flight",
            ">= 1.0",
            f"{fmt_x(r)} ({fmt_num(kv['per_s'], 0)} / {fmt_num(vl['per_s'], 0)} per s)"
            + (f"; {failed} request(s) failed" if failed else ""),
            (r >= 1.0 and failed == 0) if math.isfinite(r) else None,
        )
    g = plan.geometry
    rep.table(
        f"requests per second (median of {plan.rounds} round(s)), latency (ms) and CPU per "
        "request (us), kvpush P -> kvpush D beside vLLM P -> vLLM D",
        COLUMNS,
        rows,
        note="latency = D's registration (kvpush: decode(); vLLM: update_state_after_alloc) -> "
        "D sees the request complete (kvpush: its DecodeRep; vLLM: the engine step whose "
        "get_transfer_results reports it received), over every round's requests; CPU = the "
        "whole process (every thread) per request, median round. "
        + VLLM_INCLUDES
        + ". "
        + KVPUSH_INCLUDES
        + ".",
    )
    rep.notes.append(
        f"geometry: {g.layers} layers, one region per layer with K|V inside each block (vLLM's "
        f"CPU layout), blocks of {g.block_tokens} tokens x {g.kv_heads} KV heads x head size "
        f"{g.head_size}, {g.dtype}: {g.block_bytes:,} B per block and layer; pools: D "
        f"{plan.d_blocks:,} blocks, P {plan.p_blocks:,}, the same for both systems; one NIXL "
        "(UCX) agent per process on both sides"
    )
    rep.notes.append(
        "order alternated: in each round the cells alternate which system runs first; vLLM's "
        "processes are stopped (SIGSTOP) while kvpush runs, since vLLM's NIXL agent runs NIXL's "
        "progress thread (vLLM's default), which spins a core per process even when idle; that "
        "thread is in vLLM's CPU figures. vLLM's P holds at most twice the in-flight count "
        "finished and not yet sent (its writer scans unmatched requests per registration)"
    )
