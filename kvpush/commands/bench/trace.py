"""Scenario ``trace`` (``kvpush bench trace``, not part of ``all``): how much of a real-traffic
trace a pair, and 1 P x 2 D, can carry -- the knee of a speedup sweep.

Processes: one ``kvpush serve-prefill`` and two ``kvpush serve-decode`` on 127.0.0.1 (pools of
``d_blocks`` blocks per D, twice that on P: it holds the blocks of every D's pushes), started here
and stopped when the scenario ends, however it ends. The trace: ``--workload FILE`` (Mooncake
format), else a synthetic conversation-like one (``kvpush.commands.workload.synth``: seed 0,
3.4 requests/s, prompt lengths of the published conversation trace). Each step replays the
trace from its start with ``kvpush drive --workload TRACE --speedup S --limit L --json`` (L: the
requests of about ``step_s`` seconds at that speedup), for the pair (P -> D1) and for 1 P x 2 D,
after a warm-up drive (the handshakes are done before the first step). Speedups rise until a step
misses; the **knee** is the highest speedup at which every request was ok (none failed for lack of
blocks, ``no_free_blocks``, nor for anything else) and drive's p99 latency (request sent -> D's
answer, the push included) stayed under ``target_p99_s``. Each step also gives the pool that
would have been needed: the most blocks of requests in flight at one D at once (drive's exact
view), beside the peak D's own gauges showed.

``run_trace`` is what the command calls (the scenario registry of ``kvpush.commands.bench`` runs
``all``'s scenarios; this one is asked for by name): the result as text or one JSON line, and
``<out>/trace.json``. Runs on the caller's thread; drive and the endpoints are child processes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpush.commands.bench.common import Progress, logs_dir
from kvpush.commands.bench.procs import BenchError
from kvpush.commands.bench.report import Report, ResultDict, fmt_ms, fmt_num
from kvpush.commands.common import launch

KVPUSH = [sys.executable, "-m", "kvpush"]


@dataclass(frozen=True, kw_only=True)
class TraceParams:
    requests: int  # of the synthetic trace
    speedups: tuple[float, ...]
    step_s: float  # each step replays about this many seconds of the sped-up trace
    min_requests: int  # ... and at least this many requests
    target_p99_s: float
    d_blocks: int  # each D's pool (P's is twice that)
    seed: int = 0
    rate: float = 3.4
    layers: int = 1
    block_bytes: int = 2048
    block_tokens: int = 16
    timeout_s: float = 30.0


FULL = TraceParams(
    requests=6000,
    speedups=(2, 4, 8, 16, 32, 64, 128),
    step_s=12.0,
    min_requests=60,
    target_p99_s=0.5,
    d_blocks=16384,
)
QUICK = TraceParams(
    requests=800,
    speedups=(4, 16, 64),
    step_s=3.0,
    min_requests=30,
    target_p99_s=1.0,
    d_blocks=8192,
)


class Endpoints:
    """One P and two Ds, started together; ``close`` stops every one still alive."""

    def __init__(self, run_dir: Path, p: TraceParams) -> None:
        self.run_dir = run_dir
        self.p = p
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Endpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> tuple[str, str, str]:
        p = self.p
        geo = ["--layers", str(p.layers), "--block-bytes", str(p.block_bytes)]
        want = [("prefill", "p", 2 * p.d_blocks), ("decode", "d1", p.d_blocks),
                ("decode", "d2", p.d_blocks)]  # fmt: skip
        started = []
        for role, name, blocks in want:
            ready = self.run_dir / f"{name}.ready.json"
            cmd = [*KVPUSH, f"serve-{role}", "--port", "0", "--ready-file", str(ready),
                   "-o", "json", "--interval", "60", "--num-blocks", str(blocks), *geo]  # fmt: skip
            env = launch.child_env(keep_kvpush=False, on_path=True, plain=True)
            proc = launch.spawn(cmd, self.run_dir / f"{name}.log", env, cwd=launch.ROOT)
            self.procs.append(proc)
            started.append((proc, ready, name))
        out = []
        for proc, ready, name in started:

            def failed(why: str, n: str = name) -> BenchError:
                return BenchError(f"{n} {why}", f"see {self.run_dir}")

            info = launch.wait_ready_file(proc, ready, 120, failed)
            out.append(str(info["address"]))
        return out[0], out[1], out[2]

    def close(self) -> None:
        launch.stop_all(self.procs, launch.terminate, 20)
        self.procs = []


def _drive(*args: str, timeout_s: float) -> dict[str, Any]:
    r = subprocess.run(
        [*KVPUSH, "drive", "--json", *args], capture_output=True, text=True, timeout=timeout_s,
        env=launch.child_env(keep_kvpush=False, on_path=True, plain=True), cwd=str(launch.ROOT),
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if not r.stdout.strip():
        raise BenchError(f"drive {' '.join(args[:6])}... printed no report: {r.stderr[-500:]}")
    rep: dict[str, Any] = json.loads(r.stdout)
    return rep


def _trace(p: TraceParams, run_dir: Path, workload: str | None) -> tuple[Path, int, float]:
    """The trace file, its request count and its mean rate (requests per second)."""
    from kvpush.commands.workload.synth import SynthSpec, generate, stats
    from kvpush.commands.workload.trace import load

    if workload is not None:
        reqs = list(load(workload).requests)
        path = Path(workload)
    else:
        reqs = generate(SynthSpec(p.seed, 1e9, p.rate, 1.0, p.requests))
        path = run_dir / "synthetic.jsonl"
        path.write_text("".join(r.to_json() + "\n" for r in reqs))
    st = stats(reqs)
    return path, len(reqs), st.rate or p.rate


def _step(
    ends: list[str], trace: Path, speedup: float, limit: int, p: TraceParams
) -> dict[str, Any]:
    rep = _drive(
        *ends, "--workload", str(trace), "--speedup", f"{speedup:g}", "--limit", str(limit),
        "--block-tokens", str(p.block_tokens), "--timeout", f"{p.timeout_s:g}",
        timeout_s=limit / 1.0 + 3 * p.timeout_s + 120,
    )  # fmt: skip
    w = rep["workload"]
    pools = w["pools"].values()
    block = 2 * p.layers * p.block_bytes  # K and V regions per layer
    needed = max((d["demand_peak_blocks"] for d in pools), default=0)
    nfb = rep["failures_by_reason"].get("no_free_blocks", 0)
    within = rep["failed"] == 0 and rep["latency_s"]["p99"] <= p.target_p99_s
    return {
        "speedup": speedup,
        "requests": rep["requests"],
        "ok": rep["ok"],
        "failures_by_reason": rep["failures_by_reason"],
        "no_free_blocks": nfb,
        "offered_per_s": w["rate"]["offered_per_s"],
        "achieved_ok_per_s": w["rate"]["achieved_ok_per_s"],
        "gb_per_s": rep["gb_per_s"],
        "latency_s": rep["latency_s"],
        "lateness_p99_s": w["lateness_s"]["p99"],
        "d_peak_used_blocks": max((d["peak_used_blocks"] for d in pools), default=0),
        "d_pool_blocks": max((d["total_blocks"] for d in pools), default=0),
        "needed_blocks": needed,
        "needed_mib": needed * block / 2**20,
        "within": within,
    }


def _sweep(
    name: str, ends: list[str], trace: Path, n: int, rate: float, p: TraceParams,
    progress: Progress,
) -> list[dict[str, Any]]:  # fmt: skip
    steps = []
    for s in p.speedups:
        limit = min(n, max(p.min_requests, math.ceil(rate * s * p.step_s)))
        progress(f"trace: {name}: speedup {s:g} ({limit} requests)")
        st = _step(ends, trace, s, limit, p)
        steps.append(st)
        if not st["within"]:
            break
    return steps


def _rows(steps: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in steps:
        fails = ", ".join(f"{v} {k}" for k, v in s["failures_by_reason"].items()) or "-"
        rows.append([
            f"{s['speedup']:g}", fmt_num(s["offered_per_s"], 1), fmt_num(s["achieved_ok_per_s"], 1),
            fmt_num(s["gb_per_s"], 3), fmt_ms(s["latency_s"]["p50"]), fmt_ms(s["latency_s"]["p99"]),
            fails, f"{s['d_peak_used_blocks']:,}/{s['d_pool_blocks']:,}",
            f"{s['needed_blocks']:,} ({s['needed_mib']:.0f} MiB)", fmt_ms(s["lateness_p99_s"]),
            "yes" if s["within"] else "no",
        ])  # fmt: skip
    return rows


COLUMNS = ["speedup", "offered req/s", "ok/s", "GB/s", "p50 ms", "p99 ms", "failed",
           "D peak used/pool", "pool needed (blocks)", "late p99 ms", "within"]  # fmt: skip


def run(quick: bool, out_dir: Path, progress: Progress, workload: str | None = None) -> ResultDict:
    p = QUICK if quick else FULL
    what = workload or f"synthetic conversation-like trace ({p.requests} requests, seed {p.seed})"
    rep = Report(
        "trace",
        f"trace: the speedup a pair and 1 P x 2 D carry of {what} (p99 <= "
        f"{p.target_p99_s * 1000:g} ms, no request failed)",
        quick,
        params={**asdict(p), "workload": workload},
    )
    run_dir = logs_dir(out_dir, "trace")
    trace, n, rate = _trace(p, run_dir, workload)
    with Endpoints(run_dir, p) as eps:
        progress("trace: starting 1 P and 2 D")
        pa, d1, d2 = eps.start()
        topologies = {"pair": ["-p", pa, "-d", d1], "1 P x 2 D": ["-p", pa, "-d", d1, "-d", d2]}
        for name, ends in topologies.items():
            _drive(*ends, "-n", "20", "--blocks", "8", timeout_s=120)  # warm-up: handshakes
            steps = _sweep(name, ends, trace, n, rate, p, progress)
            rep.data[name] = steps
            rep.table(f"{name} ({pa} -> {', '.join(ends[3::2])})", COLUMNS, _rows(steps))
            knee = max((s["speedup"] for s in steps if s["within"]), default=None)
            at = next((s for s in steps if s["speedup"] == knee), None)
            rep.figures[f"knee_{name}"] = knee
            measured = (
                f"speedup {knee:g} ({at['offered_per_s']:.1f} requests/s offered, pool needed "
                f"{at['needed_blocks']:,} blocks)" if at is not None and knee is not None
                else "none: the first step missed"
            )  # fmt: skip
            rep.target(f"knee, {name}", f"p99 <= {p.target_p99_s * 1000:g} ms, all ok", measured,
                       knee is not None)  # fmt: skip
    rep.notes.append(
        f"{p.block_tokens} tokens per block of {p.layers} layer(s) x {p.block_bytes} B (K and V); "
        f"each D's pool {p.d_blocks:,} blocks, P's {2 * p.d_blocks:,}; the sweep stops at the "
        "first step that misses; 'pool needed' is the most blocks of requests in flight at one D "
        "at once (drive's view)"
    )
    return rep.to_dict()


def run_trace(quick: bool, json_out: bool, out_dir: Path | None, workload: str | None) -> None:
    """``kvpush bench trace``: run the scenario, print it, write ``<out>/trace.json``."""
    from kvpush.commands.bench import DEFAULT_OUT_DIR
    from kvpush.commands.bench.noise import HostMonitor
    from kvpush.commands.bench.render import render_text

    out = out_dir if out_dir is not None else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    monitor = HostMonitor().start()
    try:
        result = run(quick, out, lambda m: print(m, file=sys.stderr, flush=True), workload)
    finally:
        noise = monitor.stop()
    result["host_noise"] = noise
    (out / "trace.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if json_out else render_text(result), flush=True)
