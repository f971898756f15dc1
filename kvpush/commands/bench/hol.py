"""Scenario ``hol``: does a slow or dead new peer stall pushes to an established one?

Processes: P-deferred and P-blocking (``Instruments.writer``: the blocking writer is no serve
flag), D1 (established, steady load on both), and per case the joining Ds: a D whose handshake
replies take H seconds (``Instruments.handshake_reply_delay_s``: its side channel answers
late), a D that never answers (replies delayed for an hour: P's handshake times out), two
slow Ds plus a healthy third one joining 50 ms after them, and -- the third one's reference -- a
healthy D joining alone at the same point of its window (a fresh process like the third one: a
new peer's first request is compared with a new peer's, not with D1's warm second join).

Per case and writer mode, in the same run and interleaved (case by case, deferred then
blocking): D1 decodes at a steady rate (open loop, ``steady_decode``) while P prefills the same
transfers on the same schedule; mid-run the new D(s) send one request each to P. Latency is D1's
own ``DecodeRep.latency_s`` (``decode()`` to verified completion), split into *before* (issued
before the join), *during* (issued while the slow handshakes are pending: H, or P's handshake
timeout for the dead peer) and *after*.

This module owns the parameters, the cases and the measurement (``run``, ``_window``); the tables,
targets and chart are ``kvpush.commands.bench.hol_report``. Runs in the orchestrator process, on the
thread that runs the scenario; the endpoints and their load generators run in the workers.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import TypedDict

from kvpush.commands.bench import noise
from kvpush.commands.bench.common import Geometry, Progress, endpoint_cfg, logs_dir, start_at
from kvpush.commands.bench.hol_params import Case, HolParams
from kvpush.commands.bench.hol_report import MODES, Measured, report
from kvpush.commands.bench.loadgen import Recorded
from kvpush.commands.bench.passes import join_request, steady_load, steady_phases
from kvpush.commands.bench.probes import PeerReply, StatsReply
from kvpush.commands.bench.procs import Cluster, Worker
from kvpush.commands.bench.report import Report, ResultDict
from kvpush.config import Role

NEVER_S = 3600.0  # "never": the joining D answers handshakes after an hour


FULL = HolParams(before_s=2.0, delay_s=2.0, timeout_s=3.0, after_s=1.0, repeats=3)
QUICK = HolParams(
    rate=100, num_blocks=512, before_s=0.4, delay_s=0.3, timeout_s=0.6, after_s=0.2, repeats=1
)


def _cases(p: HolParams) -> list[Case]:
    return [
        Case(
            "slow",
            f"one new D answers handshakes {p.delay_s:g} s late",
            (("d2-slow", p.delay_s, 0.0),),
            "delay",
        ),
        Case(
            "dead",
            f"one new D never answers (P gives up after {p.timeout_s:g} s)",
            (("d2-dead", NEVER_S, 0.0),),
            "timeout",
        ),
        Case(
            "two-slow+healthy",
            f"two new Ds answer {p.delay_s:g} s late, a healthy third joins 50 ms later",
            (
                ("d2-slow-a", p.delay_s, 0.0),
                ("d2-slow-b", p.delay_s, 0.0),
                ("d3-healthy", 0.0, 0.05),
            ),
            "delay",
        ),
        Case(
            "alone",
            "a healthy new D joins alone, 50 ms into the window (the third peer's reference)",
            (("d3-alone", 0.0, 0.05),),
            "delay",
            reference=True,
        ),
    ]


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    p = QUICK if quick else FULL
    rep = Report(
        "hol", "hol: head-of-line blocking behind a slow new peer", quick, params=asdict(p)
    )
    timeouts = {"side_channel_s": p.timeout_s, "handshake_s": p.timeout_s}
    geo: Geometry = {"layers": p.layers, "block_bytes": p.block_bytes}
    with Cluster(logs_dir(out_dir, "hol")) as cl:
        progress("hol: starting P (deferred), P (blocking) and D1")
        cases = _cases(p)
        # The full run starts each case's joiners just before it (idle endpoints still poll);
        # --quick starts every process at once to save start-up time.
        joiner_specs = {
            c.key: {
                name: endpoint_cfg(Role.DECODE, **geo, num_blocks=64, reply_delay_s=delay)
                for name, delay, _ in c.joiners
            }
            for c in cases
        }
        early = {n: s for c in cases for n, s in joiner_specs[c.key].items()} if quick else {}
        ws = cl.endpoints(
            {
                **early,
                "p-deferred": endpoint_cfg(
                    Role.PREFILL,
                    **geo,
                    num_blocks=p.num_blocks,
                    writer="deferred",
                    timeouts=timeouts,
                ),
                "p-blocking": endpoint_cfg(
                    Role.PREFILL,
                    **geo,
                    num_blocks=p.num_blocks,
                    writer="blocking",
                    timeouts=timeouts,
                ),
                "d1": endpoint_cfg(Role.DECODE, **geo, num_blocks=p.num_blocks),
            }
        )
        ps = {m: ws[f"p-{m}"] for m in MODES}
        d1 = ws["d1"]
        normal_join, normal_hs = _quiet_joins(ps, d1, p)
        results: dict[str, list[HolWindow]] = {}
        for k in range(p.repeats):
            for case in cases:
                progress(f"hol: repeat {k + 1}/{p.repeats}, case {case.key}: {case.label}")
                if quick:
                    joiners = {name: ws[name] for name in joiner_specs[case.key]}
                else:
                    # Fresh processes every repeat: a peer is new to a P only once.
                    started = cl.endpoints(
                        {f"{n}-r{k}": s for n, s in joiner_specs[case.key].items()}
                    )
                    joiners = {n: started[f"{n}-r{k}"] for n in joiner_specs[case.key]}
                    time.sleep(1.0)  # let the new processes settle before the clock starts
                win = p.delay_s if case.window_of == "delay" else p.timeout_s
                # Alternate which writer goes first, so neither always follows the other.
                for m in MODES if k % 2 == 0 else tuple(reversed(MODES)):
                    progress(f"hol:   writer {m}")
                    results.setdefault(f"{case.key}/{m}", []).append(
                        _window(ps[m], d1, joiners, case, m, win, p, k)
                    )
                if not quick:
                    for w in joiners.values():
                        cl.stop(w)
    report(rep, p, Measured(cases, results, normal_join, normal_hs), out_dir)
    return rep.to_dict()


def _quiet_joins(
    ps: dict[str, Worker], d1: Worker, p: HolParams
) -> tuple[dict[str, float], dict[str, float]]:
    """D1 joins each P in quiet time: the "normal" join (both handshakes and the first push),
    then warms the pair. Per writer mode: that first request's latency, and P's handshake
    duration with D1."""
    normal_join: dict[str, float] = {}
    normal_hs: dict[str, float] = {}
    for m in MODES:
        t = start_at(0.2)
        f = d1.call_async(
            "decode_at",
            reply=Recorded,
            p_addr=ps[m].address,
            transfer_id=f"warm.{m}",
            t_wall=t,
            blocks=p.blocks,
        )
        ps[m].call("prefill_at", transfer_id=f"warm.{m}", t_wall=t, blocks=p.blocks)
        r = f.result(60)
        normal_join[m] = r["latency_s"][0]
        _warm(ps[m], d1, p, f"warm2.{m}.")
        normal_hs[m] = _peer_duration(ps[m], d1.address)
    return normal_join, normal_hs


def _warm(pw: Worker, d1: Worker, p: HolParams, prefix: str) -> None:
    fd, fp = steady_load(pw, d1, p, prefix, start_at(), 0.3, 60.0)
    fp.result(120)
    fd.result(60)


def _peer_row(pw: Worker, address: str) -> PeerReply | None:
    for row in pw.call("stats", reply=StatsReply)["peers"]:
        if row["peer"] == address:
            return row
    return None


def _peer_duration(pw: Worker, address: str) -> float:
    """P's handshake duration for a connected peer (NaN when it is not connected)."""
    row = _peer_row(pw, address)
    return float(row["duration_s"]) if row and row["state"] == "connected" else math.nan


def _peer_state(pw: Worker, address: str) -> str:
    row = _peer_row(pw, address)
    return row["state"] if row else "unknown"


class JoinerResult(TypedDict):
    """One joining D's first request in a window, and how P saw its handshake."""

    ok: bool
    latency_s: float | None
    reasons: dict[str, int]
    p_handshake_s: float
    p_peer_state: str


class HolWindow(TypedDict):
    """One window of one case and writer (``_window``), as ``hol_report`` reads it."""

    phases: dict[str, dict[str, float]]
    window_s: float
    joiners: dict[str, JoinerResult]
    series: list[list[float]]
    failed: int
    reasons: dict[str, int]
    generator_late_s: dict[str, float]
    host_stalls: list[list[float]]


def _window(
    pw: Worker,
    d1: Worker,
    joiners: dict[str, Worker],
    case: Case,
    mode: str,
    win: float,
    p: HolParams,
    rep: int,
) -> HolWindow:
    total = p.before_s + win + p.after_s
    t0 = start_at()
    t_join = t0 + p.before_s
    prefix = f"{case.key}.{mode}.{rep}."
    wait_s = total + 2 * win + 30
    fd, fp = steady_load(pw, d1, p, prefix, t0, total, wait_s)
    jf = _join(pw, joiners, case, f"join.{case.key}.{mode}.{rep}.", t_join, p, wait_s)
    r = fd.result(wait_s + 30)
    p_late = fp.result(60)["max_late_s"]
    joined: dict[str, JoinerResult] = {}
    for name, f in jf.items():
        jr = f.result(wait_s + 30)
        joined[name] = {
            "ok": jr["ok"][0],
            "latency_s": jr["latency_s"][0] if jr["ok"][0] else None,
            "reasons": jr["reasons"],
            "p_handshake_s": _peer_duration(pw, joiners[name].address),
            "p_peer_state": _peer_state(pw, joiners[name].address),
        }
    # Both sides idle before the next window: P has pushed everything, D1 has verified and
    # returned every block (after a blocking stall D1 verifies a backlog of hundreds).
    pw.call("wait_idle", timeout_s=30)
    d1.call("wait_idle", timeout_s=30)
    stalls = [
        [round(ts - t_join, 3), round(late * 1e3, 1)]
        for ts, late in noise.stalls_between(t0, t_join + win + p.after_s + 1.0)
    ]
    t = [x - p.before_s for x in r["t_call"]]  # seconds since the join
    lat, ok = r["latency_s"], r["ok"]
    return {
        "phases": steady_phases(t, lat, ok, p.before_s, win),
        "window_s": win,
        "joiners": joined,
        "series": [[round(a, 4), round(b, 6)] for a, b, g in zip(t, lat, ok, strict=True) if g],
        "failed": sum(1 for g in ok if not g),
        "reasons": r["reasons"],
        "generator_late_s": {"d1": r["max_late_s"], "p": p_late},
        "host_stalls": stalls,
    }


def _join(
    pw: Worker,
    joiners: dict[str, Worker],
    case: Case,
    prefix: str,
    t_join: float,
    p: HolParams,
    wait_s: float,
) -> dict[str, Future[Recorded]]:
    """Each joining D of ``case`` sends one request at its offset after ``t_join`` (P prefills
    it just ahead); the futures of their ``decode_at`` answers by joiner name."""
    jf = {}
    for name, _, offset in case.joiners:
        jf[name] = join_request(
            pw,
            joiners[name],
            f"{prefix}{name}",
            t_join + offset,
            p.blocks,
            deadline_s=max(p.timeout_s, 2 * p.delay_s) + p.after_s + 1.0,
            wait_s=wait_s,
        )
    return jf
