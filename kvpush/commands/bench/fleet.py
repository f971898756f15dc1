"""Scenario ``fleet``: a fleet of P and D endpoints registered in one etcd, seen and checked.

Processes: a real etcd (the ``etcd`` binary next to the interpreter, as the tests use, or
``KVPUSH_ETCD_BIN``), ``P`` prefill and ``D`` decode ``kvpush serve-*`` processes with small
pools, each registered (``--registry``), and two more P -> D pairs *not* registered (the
baseline of the registration's cost, and the spread between two identical unregistered pairs:
the noise the comparison is read against). All are started here and killed when the scenario
ends, however it ends. Measured:

* start-up of ``kvpush fleet ls --json`` and of ``kvpush fleet watch --json`` (process start to
  the listing / the first line), with every endpoint registered;
* ``fleet check`` of P x D pairs at the default concurrency, for growing grids (e.g. 2x4, 4x8,
  8x16), in-process (``kvpush.commands.fleet.check.check_fleet``: the command's own code without the
  interpreter's start-up);
* the registry's request rate: etcd's own counters (``grpc_server_started_total``: every gateway
  request is one gRPC call there) over an idle window (lease refreshes and load summaries of the
  whole fleet) and during the check;
* push latency p99 through a registered P -> D pair vs the unregistered pair, the same drive in
  alternating rounds after a warm-up drive on each (the registry is not on the data path: the
  goal is within 5 %);
* the fleet at scale (``kvpush.commands.bench.fleet_scale``, its own etcd): registry events and
  CPU of a real P and D among 100, 300 and 1,000 simulated members under steady load, etcd
  writes per member, ``fleet ls`` at 1,000, and the first request to a newly joined D with and
  without ``--prewarm``.

The processes are ``kvpush.commands.bench.fleet_procs``'s.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvpush.commands.bench import fleet_scale
from kvpush.commands.bench.common import Progress, logs_dir
from kvpush.commands.bench.fleet_procs import (
    CLUSTER,
    Fleet,
    cli,
    etcd_binary,
    etcd_requests,
    python_start,
    rates,
    wait_ready,
    watch_startup,
)
from kvpush.commands.bench.procs import BenchError
from kvpush.commands.bench.report import Report, ResultDict, fmt_ms, fmt_num, fmt_x
from kvpush.commands.bench.stats import median, ratio
from kvpush.config import Role

__all__ = ["CLUSTER", "Fleet", "FleetParams", "etcd_binary", "run"]


@dataclass(frozen=True, kw_only=True)
class FleetParams:
    """What ``--quick`` sizes down has no default; the rest is the same in both runs."""

    prefills: int
    decodes: int
    grid: tuple[tuple[int, int], ...]  # (Ps, Ds) of each check
    num_blocks: int = 64
    layers: int = 2
    block_bytes: int = 4096
    check_size: int = 64 << 10  # bytes per check push
    idle_s: float  # window for the idle registry rate
    drive_requests: int
    drive_rounds: int
    drive_concurrency: int
    drive_blocks: int = 4
    cli_runs: int  # fleet ls / watch start-ups timed

    @property
    def pool(self) -> tuple[int, int, int]:
        return (self.num_blocks, self.layers, self.block_bytes)


FULL = FleetParams(
    prefills=8,
    decodes=16,
    grid=((2, 4), (4, 8), (8, 16)),
    idle_s=20.0,
    drive_requests=1500,
    drive_rounds=3,
    drive_concurrency=4,
    cli_runs=3,
)
QUICK = FleetParams(
    prefills=2,
    decodes=2,
    grid=((1, 1), (2, 2)),
    idle_s=3.0,
    drive_requests=100,
    drive_rounds=1,
    drive_concurrency=2,
    cli_runs=1,
)


def _drive_p99(p: str, d: str, params: FleetParams) -> dict[str, Any]:
    _, r = cli(
        "drive", "-p", p, "-d", d, "-n", str(params.drive_requests),
        "-c", str(params.drive_concurrency), "--blocks", str(params.drive_blocks), "--json",
    )  # fmt: skip
    if r.returncode != 0 or not r.stdout.strip():
        raise BenchError(f"drive {p} -> {d} failed: {r.stderr[-500:]}")
    rep: dict[str, Any] = json.loads(r.stdout)
    return rep


def run(quick: bool, out_dir: Path, progress: Progress) -> ResultDict:
    from kvpush.fleet.etcd import Etcd
    from kvpush.fleet.record import loads_prefix, members_prefix
    from kvpush.fleet.store import list_endpoints

    p = QUICK if quick else FULL
    rep = Report(
        "fleet",
        f"fleet: {p.prefills} P x {p.decodes} D registered in etcd: fleet ls/watch/check, "
        "registry load, push p99 with registration on vs off",
        quick,
        params=asdict(p),
    )
    run_dir = logs_dir(out_dir, "fleet")
    with Fleet(run_dir) as fl:
        progress("fleet: starting etcd")
        url = fl.start_etcd()
        n = p.prefills + p.decodes
        progress(f"fleet: starting {n} registered endpoints and two unregistered pairs")
        readies = [fl.serve(Role.PREFILL, f"p{i}", p.pool, True) for i in range(p.prefills)]
        readies += [fl.serve(Role.DECODE, f"d{i}", p.pool, True) for i in range(p.decodes)]
        readies += [
            fl.serve(Role.PREFILL, "p-off", p.pool, False),
            fl.serve(Role.DECODE, "d-off", p.pool, False),
        ]
        readies += [
            fl.serve(Role.PREFILL, "p-off2", p.pool, False),
            fl.serve(Role.DECODE, "d-off2", p.pool, False),
        ]
        infos = wait_ready(readies, timeout_s=120 + 10 * n)
        off_p, off_d = infos[-4]["address"], infos[-3]["address"]
        off2_p, off2_d = infos[-2]["address"], infos[-1]["address"]
        etcd = Etcd(url, timeout_s=5.0)
        records = _registered(etcd, n)
        kvs, _ = etcd.get_prefix(members_prefix(CLUSTER))
        key_bytes = [len(k.encode()) for k, _ in kvs]
        value_bytes = [len(v) for _, v in kvs]
        load_bytes = [len(v) for _, v in etcd.get_prefix(loads_prefix(CLUSTER))[0]]

        progress("fleet: fleet ls / fleet watch start-up")
        ls_s, watch_s = _startup(url, n, p.cli_runs)
        t0 = time.monotonic()
        list_endpoints(etcd, CLUSTER)
        list_in_process = time.monotonic() - t0
        py_start = python_start()

        progress(f"fleet: registry load over {p.idle_s:g} s idle")
        before = etcd_requests(url)
        time.sleep(p.idle_s)
        idle = rates(before, etcd_requests(url), p.idle_s)

        ps = sorted((r for r in records if r.role == Role.PREFILL), key=lambda r: r.address)
        ds = sorted((r for r in records if r.role == Role.DECODE), key=lambda r: r.address)
        checks = _checks(url, ps, ds, p, progress)

        progress("fleet: push p99, registration on vs off")
        pairs = [
            ("on", ps[0].address, ds[0].address),
            ("off", off_p, off_d),
            ("off2", off2_p, off2_d),
        ]
        rounds = _p99_rounds(pairs, p)
    measured = {
        "n": n, "ls_s": ls_s, "watch_s": watch_s, "list_in_process": list_in_process,
        "python_start": py_start, "idle": idle, "checks": checks, "rounds": rounds,
        "key_bytes": key_bytes, "value_bytes": value_bytes, "load_bytes": load_bytes,
    }  # fmt: skip
    progress("fleet: at scale (simulated members beside a real P and D)")
    scale = fleet_scale.measure(
        logs_dir(out_dir, "fleet-scale"),
        fleet_scale.QUICK_SCALE if quick else fleet_scale.FULL_SCALE,
        progress,
    )
    _report(rep, p, measured)
    fleet_scale.report(rep, scale)
    return rep.to_dict()


def _registered(etcd: Any, n: int) -> list[Any]:
    """Wait (60 s at most) until all ``n`` endpoints are registered; their records."""
    from kvpush.fleet.store import list_endpoints

    deadline = time.monotonic() + 60
    while True:
        records, _ = list_endpoints(etcd, CLUSTER)
        if len(records) == n:
            return records
        if time.monotonic() > deadline:
            raise BenchError(f"{len(records)} of {n} endpoints registered after 60 s")
        time.sleep(0.5)


def _startup(url: str, n: int, runs: int) -> tuple[list[float], list[float]]:
    """Seconds from process start to output of ``fleet ls`` and of ``fleet watch``, ``runs``
    times each."""
    ls_s, watch_s = [], []
    for _ in range(runs):
        took, r = cli("fleet", "ls", "--json", "--registry", url, "--cluster", CLUSTER)
        if r.returncode != 0 or len(json.loads(r.stdout)["endpoints"]) != n:
            raise BenchError(f"fleet ls failed: {r.stderr[-300:]}")
        ls_s.append(took)
        watch_s.append(watch_startup(url))
    return ls_s, watch_s


def _checks(
    url: str, ps: list[Any], ds: list[Any], p: FleetParams, progress: Progress
) -> list[dict[str, Any]]:
    """``fleet check`` in process over each grid of P x D, with the registry's load meanwhile."""
    from kvpush.commands.fleet.check import CheckConfig, check_fleet

    checks = []
    cfg = CheckConfig(size_bytes=p.check_size)
    for k, m in p.grid:
        progress(f"fleet: fleet check {k}x{m}")
        b0 = etcd_requests(url)
        t0 = time.monotonic()
        crep = check_fleet(CLUSTER, [*ps[:k], *ds[:m]], cfg)
        took = time.monotonic() - t0
        during = rates(b0, etcd_requests(url), took)
        p50s = [x.p50_ms for x in crep.pairs if x.p50_ms is not None]
        checks.append(
            {
                "grid": f"{k}x{m}",
                "pairs": len(crep.pairs),
                "seconds": took,
                "ok": crep.count("ok"),
                "failed": [f"{x.prefill}->{x.decode}: {x.reason}" for x in crep.failed],
                "pair_p50_ms_median": median(p50s),
                "first_ms_median": median(
                    [x.first_ms for x in crep.pairs if x.first_ms is not None]
                ),
                "registry_rps_during": sum(during.values()),
            }
        )
    return checks


def _p99_rounds(pairs: list[tuple[str, str, str]], p: FleetParams) -> list[dict[str, Any]]:
    """``kvpush drive`` latency per (label, P, D) pair, every pair warm first, rounds rotating
    which pair goes first."""
    rounds: list[dict[str, Any]] = []
    warm = replace(p, drive_requests=max(20, p.drive_requests // 10))
    for _, pa, da in pairs:  # every pair connected and warm first
        _drive_p99(pa, da, warm)
    for i in range(p.drive_rounds):
        for label, pa, da in pairs[i % 3 :] + pairs[: i % 3]:  # each goes first once
            d = _drive_p99(pa, da, p)
            rounds.append(
                {"label": label, "round": i, **d["latency_s"], "ok": d["ok"],
                 "verified": d["verified"], "requests_per_s": d["requests_per_s"]}
            )  # fmt: skip
    return rounds


def _report(rep: Report, p: FleetParams, m: dict[str, Any]) -> ResultDict:
    n = m["n"]
    rep.table(
        f"start-up with {n} endpoints registered (process start to output, median of {p.cli_runs})",
        ["command", "seconds", "note"],
        [
            ["kvpush fleet ls --json", fmt_num(median(m["ls_s"])), "whole listing printed"],
            ["kvpush fleet watch --json", fmt_num(median(m["watch_s"])), "snapshot line printed"],
            ["kvpush --version", fmt_num(m["python_start"]), "the interpreter + CLI alone"],
            ["list_endpoints (in process)", fmt_num(m["list_in_process"], 4), "one etcd range"],
        ],
    )
    rows = []
    for c in m["checks"]:
        rows.append(
            [
                c["grid"], str(c["pairs"]), fmt_num(c["seconds"]),
                fmt_ms(c["seconds"] / max(1, c["pairs"])), f"{c['ok']}/{c['pairs']}",
                fmt_num(c["first_ms_median"]), fmt_num(c["pair_p50_ms_median"]),
                fmt_num(c["registry_rps_during"], 1),
            ]
        )  # fmt: skip
    rep.table(
        f"fleet check at the default concurrency ({8}), {p.check_size >> 10} KiB pushes, 3 per "
        "pair",
        ["P x D", "pairs", "seconds", "ms / pair", "ok", "first push ms (median)",
         "push p50 ms (median)", "etcd req/s"],
        rows,
        note="in process (check_fleet): the command's code without the interpreter start-up",
    )  # fmt: skip
    idle_total = sum(m["idle"].values())
    rep.table(
        f"registry load: etcd gRPC calls/s, idle fleet of {n} endpoints over {p.idle_s:g} s",
        ["method", "calls/s", "per endpoint"],
        [[k, fmt_num(v), fmt_num(v / n, 3)] for k, v in m["idle"].items()]
        + [["total", fmt_num(idle_total), fmt_num(idle_total / n, 3)]],
        note="grpc_server_started_total from etcd's /metrics (each HTTP gateway request is one "
        "gRPC call)",
    )
    on = [r for r in m["rounds"] if r["label"] == "on"]
    off = [r for r in m["rounds"] if r["label"] == "off"]
    rep.table(
        f"push latency (drive, {p.drive_requests} requests of {p.drive_blocks} blocks, -c "
        f"{p.drive_concurrency}) through a registered pair vs two unregistered ones",
        ["round", "registration", "p50 ms", "p99 ms", "max ms", "ok", "verified", "req/s"],
        [
            [
                str(r["round"]),
                r["label"],
                fmt_ms(r["p50"]),
                fmt_ms(r["p99"]),
                fmt_ms(r["max"]),
                str(r["ok"]),
                str(r["verified"]),
                fmt_num(r["requests_per_s"], 0),
            ]
            for r in m["rounds"]
        ],
    )
    off2 = [r for r in m["rounds"] if r["label"] == "off2"]
    p99_on, p99_off = median([r["p99"] for r in on]), median([r["p99"] for r in off])
    p99_off2 = median([r["p99"] for r in off2])
    p99_ratio = ratio(p99_on, p99_off)
    spread = ratio(p99_off2, p99_off)
    full = m["checks"][-1]
    rep.target(
        f"fleet check of all {full['pairs']} pairs",
        "< 30 s at the default concurrency",
        f"{full['seconds']:.1f} s ({full['ok']}/{full['pairs']} ok)",
        None if p is QUICK else full["seconds"] < 30,
    )
    rep.target(
        "push p99, registration on / off",
        "within 5 %",
        f"{fmt_x(p99_ratio)} ({fmt_ms(p99_on)} / {fmt_ms(p99_off)} ms, median of {len(on)} rounds)",
        None if p is QUICK else abs(p99_ratio - 1) <= 0.05,
    )
    rep.target(
        "noise floor: p99 of two unregistered pairs (off2 / off)",
        "(none: the spread the 5 % goal is read against)",
        f"{fmt_x(spread)} ({fmt_ms(p99_off2)} / {fmt_ms(p99_off)} ms)",
        None,
    )
    rep.figures.update(
        {
            "p99_off2_s": p99_off2,
            "p99_off2_off": spread,
            "endpoints": n,
            "fleet_ls_s": m["ls_s"],
            "fleet_watch_startup_s": m["watch_s"],
            "python_start_s": m["python_start"],
            "list_in_process_s": m["list_in_process"],
            "checks": m["checks"],
            "registry_idle_rps": m["idle"],
            "registry_idle_rps_total": idle_total,
            "p99_on_s": p99_on,
            "p99_off_s": p99_off,
            "p99_on_off": p99_ratio,
            "key_bytes_median": median([float(x) for x in m["key_bytes"]]),
            "value_bytes_median": median([float(x) for x in m["value_bytes"]]),
            "load_value_bytes_median": median([float(x) for x in m["load_bytes"]]),
        }
    )
    if any(c["failed"] for c in m["checks"]):
        rep.notes.append(
            "pairs failed in the check: "
            + "; ".join(f for c in m["checks"] for f in c["failed"][:3])
        )
    return rep.to_dict()
