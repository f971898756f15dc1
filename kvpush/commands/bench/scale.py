"""Scenario ``scale``: a storm of new D endpoints joins one P while established pushes continue.

Processes: one P (deferred writer), D1 (established, steady open-loop load, as in ``hol``) and
``N`` new D endpoints, each in its own process, that all send their first request to P at the
same instant. Measured: each new D's first request (D-measured: notif-only handshake to P, P's
full handshake back, the push, verification) and P's handshake duration for it (P telemetry);
the time until *all* are connected; D1's latency before the storm, during it (until the last
new D is connected) and after.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.commands.bench import noise
from kvpush.commands.bench.chart import Panel, Series, line_chart
from kvpush.commands.bench.common import (
    Geometry,
    Progress,
    endpoint_cfg,
    logs_dir,
    start_at,
    warmup_s,
)
from kvpush.commands.bench.loadgen import Recorded
from kvpush.commands.bench.passes import SteadyLoad, join_request, steady_load, steady_phases
from kvpush.commands.bench.probes import StatsReply
from kvpush.commands.bench.procs import Cluster
from kvpush.commands.bench.report import Report, ResultDict, fmt_ms, fmt_x
from kvpush.commands.bench.stats import median, ratio
from kvpush.config import Role

if TYPE_CHECKING:
    from kvpush.commands.bench.loadgen import SteadyDecodeResult


@dataclass(frozen=True, kw_only=True)
class ScaleParams(SteadyLoad):
    new_peers: int
    before_s: float
    storm_s: float  # how long D1's "during" recording lasts at least
    after_s: float


FULL = ScaleParams(new_peers=8, before_s=2.0, storm_s=1.0, after_s=1.0)
QUICK = ScaleParams(new_peers=4, rate=100, num_blocks=512, before_s=0.6, storm_s=0.5, after_s=0.3)


def _stall_cell(stalls: list[tuple[float, float]], lo: float, hi: float) -> str:
    big = [ms for t, ms in stalls if lo <= t < hi and ms > 50]
    return f"{len(big)} (max {max(big):.0f} ms)" if big else "0"


@dataclass
class _Storm:
    """What one storm measured (see ``_measure``)."""

    names: list[str]
    quiet_join: float  # D1's first request in quiet time (s)
    d1: SteadyDecodeResult
    p_late: float  # how far P's open-loop generator fell behind (s)
    joins: dict[str, Recorded]  # each new D's decode_at result
    stalls: list[tuple[float, float]]  # host stalls: (s since the storm, ms late)
    hs: dict[str, float]  # P's handshake duration per new D (s)
    d1_hs: float


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    p = QUICK if quick else FULL
    rep = Report(
        "scale",
        f"scale: {p.new_peers} new D endpoints join at once during steady pushes",
        quick,
        params=asdict(p),
    )
    m = _measure(p, out_dir, progress)
    _report(rep, p, m, out_dir)
    return rep.to_dict()


def _measure(p: ScaleParams, out_dir: Path, progress: Progress) -> _Storm:
    """P, D1 and the new Ds: D1 joins in quiet time, then steady load, and mid-run every new D
    sends its first request at the same instant."""
    geo: Geometry = {"layers": p.layers, "block_bytes": p.block_bytes}
    names = [f"d-new{k}" for k in range(p.new_peers)]
    with Cluster(logs_dir(out_dir, "scale")) as cl:
        progress(f"scale: starting P, D1 and {p.new_peers} new D endpoints")
        specs = {
            "p": endpoint_cfg(Role.PREFILL, **geo, num_blocks=p.num_blocks),
            "d1": endpoint_cfg(Role.DECODE, **geo, num_blocks=p.num_blocks),
        }
        specs.update({n: endpoint_cfg(Role.DECODE, **geo, num_blocks=16) for n in names})
        ws = cl.endpoints(specs, timeout_s=180)
        pw, d1 = ws["p"], ws["d1"]
        # D1 joins in quiet time (the reference join), then warms up.
        tw = start_at(0.2)
        f = d1.call_async(
            "decode_at",
            reply=Recorded,
            p_addr=pw.address,
            transfer_id="warm",
            t_wall=tw,
            blocks=p.blocks,
        )
        pw.call("prefill_at", transfer_id="warm", t_wall=tw, blocks=p.blocks)
        quiet_join = f.result(60)["latency_s"][0]
        progress("scale: steady load, then the storm")
        total = p.before_s + p.storm_s + p.after_s + 1.0
        t0 = start_at(0.6)
        t_join = t0 + p.before_s
        fd, fp = steady_load(pw, d1, p, "s.", t0, total, total + 60)
        jf = {n: join_request(pw, ws[n], f"storm.{n}", t_join, p.blocks, wait_s=120) for n in names}
        r = fd.result(total + 120)
        p_late = fp.result(60)["max_late_s"]
        joins = {n: jf[n].result(180) for n in names}
        stalls = [
            (round(ts - t_join, 3), round(late * 1e3, 1))
            for ts, late in noise.stalls_between(t0, t0 + total + 1.0)
        ]
        peers = {
            row["peer"]: row["duration_s"] for row in pw.call("stats", reply=StatsReply)["peers"]
        }
        hs = {n: float(peers.get(ws[n].address, math.nan)) for n in names}
        d1_hs = float(peers.get(d1.address, math.nan))
    return _Storm(names, quiet_join, r, p_late, joins, stalls, hs, d1_hs)


def _report(rep: Report, p: ScaleParams, m: _Storm, out_dir: Path) -> None:
    """Tables, targets, figures and chart of one storm."""
    names, joins, stalls, hs = m.names, m.joins, m.stalls, m.hs
    quiet_join, d1_hs, p_late, r = m.quiet_join, m.d1_hs, m.p_late, m.d1
    # analysis
    join_lat = {n: (j["latency_s"][0] if j["ok"][0] else None) for n, j in joins.items()}
    done = [x for x in join_lat.values() if x is not None]
    all_ok = len(done) == len(names)
    all_connected = max(done) if done else math.nan
    during_end = max(p.storm_s, all_connected if math.isfinite(all_connected) else p.storm_s)
    t = [x - p.before_s for x in r["t_call"]]
    lat, ok = r["latency_s"], r["ok"]
    phases = steady_phases(t, lat, ok, p.before_s, during_end)
    w0 = -p.before_s + warmup_s(p.before_s)  # where "before" starts, as steady_phases counts it
    rep.table(
        f"D1 latency (ms, D-measured) at {p.rate:g} req/s while {p.new_peers} new Ds join",
        [
            "phase",
            "window (s since storm)",
            "requests",
            "p50",
            "p99",
            "max",
            "failed",
            "host stalls",
        ],
        [
            [
                ph,
                {
                    "before": f"{w0:g}..0",
                    "during": f"0..{during_end:.2f}",
                    "after": f"{during_end:.2f}..",
                }[ph],
                str(v["n"]),
                fmt_ms(v["p50"]),
                fmt_ms(v["p99"]),
                fmt_ms(v["max"]),
                str(v["failed"]),
                _stall_cell(stalls, lo, hi),
            ]
            for ph, v, lo, hi in (
                ("before", phases["before"], w0, 0.0),
                ("during", phases["during"], 0.0, during_end),
                ("after", phases["after"], during_end, math.inf),
            )
        ],
        note=f"'during' lasts until the last new D had its first push (at least {p.storm_s:g} "
        "s). 'host stalls' = times the bench's 5 ms timer thread woke more than 50 ms late (no "
        "CPU was free for it).",
    )
    rows = [["D1 (quiet join, reference)", fmt_ms(quiet_join), fmt_ms(d1_hs), "ok"]]
    for n in names:
        j = joins[n]
        rows.append(
            [
                n,
                fmt_ms(join_lat[n]),
                fmt_ms(hs[n]),
                "ok" if j["ok"][0] else ",".join(j["reasons"]) or "failed",
            ]
        )
    rep.table(
        "new peers: first request (ms, D-measured: both handshakes + push + verify) and "
        "P->D handshake (ms, P telemetry)",
        ["peer", "first request", "P->D handshake", "outcome"],
        rows,
    )
    growth = ratio(phases["during"]["p99"], phases["before"]["p99"])
    rep.target(
        f"all {p.new_peers} new peers connected",
        "all",
        f"{len(done)}/{len(names)} in {fmt_ms(all_connected)} ms (median "
        f"{fmt_ms(median(done))} ms; quiet join {fmt_ms(quiet_join)} ms)",
        all_ok,
    )
    rep.target(
        "D1 p99 during the storm / before",
        "(no target set; hol asks <= 2x for one slow peer)",
        f"{fmt_x(growth)} ({fmt_ms(phases['during']['p99'])} / "
        f"{fmt_ms(phases['before']['p99'])} ms)",
        None,
    )
    rep.figures.update(
        {
            "all_connected_s": all_connected,
            "join_latency_s": join_lat,
            "p_handshake_s": hs,
            "quiet_join_s": quiet_join,
            "d1_phases": phases,
            "d1_p99_growth": growth,
            "generator_max_late_s": max(p_late, r["max_late_s"]),
            "host_stalls": stalls,
        }
    )
    if max(p_late, r["max_late_s"]) > 0.02:
        rep.notes.append(
            f"the open-loop generators fell up to {max(p_late, r['max_late_s']) * 1e3:.0f} ms "
            "behind schedule: a thread of P or D1 did not get the CPU in time (other jobs, or the "
            "endpoints' own threads: see host noise and BENCHMARKS.md)"
        )
    rep.data["d1_series"] = [
        [round(a, 4), round(b, 6)] for a, b, g in zip(t, lat, ok, strict=True) if g
    ]
    panel = Panel(
        title=f"D1 latency while {p.new_peers} new Ds join at t=0; "
        "dots: each new D's first request",
        series=[
            Series(
                "D1 (established)",
                [(a, b * 1e3) for a, b, g in zip(t, lat, ok, strict=True) if g],
                color="#1f77b4",
                style="trace",
            ),
            Series(
                "new D first request", [(x, x * 1e3) for x in done], color="#d62728", style="dots"
            ),
        ],
        xlabel="seconds since the storm",
        ylabel="ms (log)",
        logy=True,
        spans=[(0.0, during_end, "joining")],
        marks=[x for x, _ in stalls],
    )
    path = out_dir / "scale.svg"
    path.write_text(line_chart([panel], "scale: a handshake storm during steady pushes"))
    rep.charts.append(str(path))
