"""``bench fleet``'s scale rows: a registered P and D among hundreds of simulated members.

Processes: a real etcd, one real P and one real D (``serve-* --registry --metrics-port``), and
per row one ``kvpush.commands.bench.fleet_sim`` process holding ``members`` simulated
registrants whose load summaries change every load period (a fleet under steady load). All are
started here and killed when the run ends, however it ends. Measured, per row, over a window
that starts once every member is registered and the joins were digested:

* registry events each real endpoint received per second: its own
  ``kvpush_registry_watch_events_total``; an endpoint without that counter (layout v1) is
  read through a copy of its watch (the same prefix, counted here);
* each real endpoint's CPU (``/proc``: its whole process; the data path is idle meanwhile);
* etcd's requests per second, all clients together.

Besides: etcd writes per real member per second while ``drive`` pushes through the pair at a
steady rate; ``kvpush fleet ls --json`` at the largest size (process start to the listing, and
minus the interpreter's start); and the first request to a newly joined D, with and without
``serve-* --prewarm`` (where this kvpush has it), beside the same pair's steady p50
(``kvpush.commands.bench.fleet_first``).

``measure`` returns plain numbers; ``report`` adds the tables and targets to a ``Report``.
``python -m kvpush.commands.bench.fleet_scale [--quick] [--out-dir DIR]`` runs this part alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpush.commands.bench.common import Progress, logs_dir
from kvpush.commands.bench.fleet_first import first_requests
from kvpush.commands.bench.fleet_procs import (
    CLUSTER,
    Fleet,
    cli,
    cpu_s,
    etcd_requests,
    python_start,
    rates,
    scrape,
    wait_ready,
)
from kvpush.commands.bench.procs import BenchError
from kvpush.commands.bench.report import Report, fmt_ms, fmt_num, fmt_x
from kvpush.commands.bench.stats import median, ratio
from kvpush.commands.common.ports import free_port
from kvpush.config import Role

EVENTS = "kvpush_registry_watch_events_total"
POOL = (64, 2, 4096)


@dataclass(frozen=True, kw_only=True)
class ScaleParams:
    members: tuple[int, ...]  # simulated members of each row
    periods: tuple[float, ...]  # load periods; the first at every size, the others at the largest
    window_s: float
    settle_s: float
    joins: int  # newly joined Ds timed per prewarm mode
    steady_requests: int
    ls_runs: int
    drive_rate: float = 20.0  # requests/s through the real pair while writes are counted


FULL_SCALE = ScaleParams(
    members=(100, 300, 1000), periods=(2.0, 10.0), window_s=20.0, settle_s=8.0, joins=5,
    steady_requests=100, ls_runs=3,
)  # fmt: skip
QUICK_SCALE = ScaleParams(
    members=(20, 50), periods=(2.0,), window_s=4.0, settle_s=3.0, joins=1, steady_requests=20,
    ls_runs=1,
)  # fmt: skip


def peer_watch_prefix(cluster: str) -> str:
    """The prefix an endpoint's own peer watch follows (layout v2: the membership keys; v1's
    endpoints followed the whole cluster, ``/kvpush/v1/clusters/<c>/endpoints/``)."""
    from kvpush.fleet.record import members_prefix

    return members_prefix(cluster)


def has_prewarm() -> bool:
    from kvpush.commands.common import endpoint_options

    return any(o.name == "prewarm" for o in endpoint_options.ENDPOINT_OPTS)


class Mirror:
    """A copy of an endpoint's peer watch, counting what it receives (layout v1's endpoints
    have no counter of their own)."""

    def __init__(self, url: str, prefix: str) -> None:
        from kvpush.fleet.etcd import Etcd

        self.count = 0
        self._events, self._cancel = Etcd(url, timeout_s=5.0).watch_prefix(prefix)
        self._thread = threading.Thread(target=self._run, name="bench-mirror", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for _ in self._events:
                self.count += 1
        except Exception:  # the watch broke: the count stops (the run's rows say so)
            self.count = -1 << 40

    def close(self) -> None:
        self._cancel()
        self._thread.join(5.0)


@dataclass(frozen=True)
class Real:
    role: str
    address: str
    pid: int
    metrics: str


def _sample(url: str, reals: list[Real], mirror: Mirror) -> dict[str, Any]:
    return {
        "t": time.monotonic(),
        "cpu": [cpu_s(r.pid) for r in reals],
        "events": [scrape(r.metrics, EVENTS) for r in reals],
        "mirror": mirror.count,
        "etcd": etcd_requests(url),
    }


def _window(url: str, reals: list[Real], mirror: Mirror, secs: float) -> dict[str, Any]:
    a = _sample(url, reals, mirror)
    time.sleep(secs)
    b = _sample(url, reals, mirror)
    dt = b["t"] - a["t"]
    events: list[float] = []
    source = "counter"
    for x, y in zip(a["events"], b["events"], strict=True):
        if x is None or y is None:
            source = "watch copy"
            events.append((b["mirror"] - a["mirror"]) / dt)
        else:
            events.append((y - x) / dt)
    return {
        "seconds": dt,
        "events_per_s": events,
        "events_source": source,
        "cpu_pct": [100 * (y - x) / dt for x, y in zip(a["cpu"], b["cpu"], strict=True)],
        "etcd": rates(a["etcd"], b["etcd"], dt),
    }


def _start_reals(fl: Fleet) -> list[Real]:
    ports = [free_port(), free_port()]
    files = [
        fl.serve(role, f"real-{role}", POOL, True, ["--metrics-port", str(port)])
        for role, port in zip((Role.PREFILL, Role.DECODE), ports, strict=True)
    ]
    infos = wait_ready(files, timeout_s=180)
    return [
        Real(str(i["role"]), str(i["address"]), int(i["pid"]), f"http://127.0.0.1:{port}/metrics")
        for i, port in zip(infos, ports, strict=True)
    ]


def _registered(url: str, want: int, timeout_s: float = 120.0) -> float:
    """Wait until ``want`` endpoints are listed; how long one listing took (in process)."""
    from kvpush.fleet.etcd import Etcd
    from kvpush.fleet.store import list_endpoints

    etcd = Etcd(url, timeout_s=10.0)
    deadline = time.monotonic() + timeout_s
    while True:
        t0 = time.monotonic()
        records, _ = list_endpoints(etcd, CLUSTER)
        took = time.monotonic() - t0
        if len(records) >= want:
            return took
        if time.monotonic() > deadline:
            raise BenchError(f"{len(records)} of {want} endpoints registered after {timeout_s:g}s")
        time.sleep(0.5)


def _row(
    fl: Fleet, reals: list[Real], mirror: Mirror, n: int, period: float, p: ScaleParams,
    ls: bool,
) -> dict[str, Any]:  # fmt: skip
    """One size: ``n`` simulated members at ``period``; the window's figures (and ``fleet ls``
    at this size when ``ls``)."""
    ready = fl.run_dir / f"sim-{n}-{period:g}.ready.json"
    sim = fl.spawn(
        [sys.executable, "-m", "kvpush.commands.bench.fleet_sim", fl.url, CLUSTER, str(n),
         str(period), str(ready)],
        f"sim-{n}-{period:g}.log",
    )  # fmt: skip
    try:
        wait_ready([ready], timeout_s=300)
        list_s = _registered(fl.url, n + len(reals))
        time.sleep(p.settle_s)
        out = {"members": n, "period_s": period, **_window(fl.url, reals, mirror, p.window_s)}
        out["list_in_process_s"] = list_s
        if ls:
            out["ls_s"] = _fleet_ls(fl.url, n + len(reals), p.ls_runs)
    finally:
        Path(str(ready) + ".stop").touch()  # the sim revokes its leases: every member leaves
        try:
            sim.wait(60)
        except subprocess.TimeoutExpired:
            fl.stop(sim.pid)
    time.sleep(p.settle_s)  # the leaves are digested before the next row
    return out


def _fleet_ls(url: str, n: int, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        took, r = cli("fleet", "ls", "--json", "--registry", url, "--cluster", CLUSTER)
        if r.returncode != 0 or len(json.loads(r.stdout)["endpoints"]) != n:
            raise BenchError(f"fleet ls failed: {r.stderr[-300:]}")
        out.append(took)
    return out


def _writes(fl: Fleet, reals: list[Real], mirror: Mirror, p: ScaleParams) -> dict[str, Any]:
    """etcd's requests/s per real member while drive pushes through the pair at a steady rate."""
    n = int(p.drive_rate * (p.window_s + p.settle_s + 10))
    drive = subprocess.Popen(
        [sys.executable, "-m", "kvpush", "drive", "-p", reals[0].address, "-d", reals[1].address,
         "-n", str(n), "--rate", str(p.drive_rate), "-c", "2", "--blocks", "4", "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(p.settle_s)
        w = _window(fl.url, reals, mirror, p.window_s)
    finally:
        drive.terminate()
        drive.wait(30)
    return {k: v / len(reals) for k, v in w["etcd"].items()}


def measure(run_dir: Path, p: ScaleParams, progress: Progress) -> dict[str, Any]:
    out: dict[str, Any] = {"params": asdict(p), "rows": []}
    with Fleet(run_dir) as fl:
        progress("fleet scale: starting etcd, a real P and a real D")
        fl.start_etcd()
        reals = _start_reals(fl)
        _registered(fl.url, len(reals))
        mirror = Mirror(fl.url, peer_watch_prefix(CLUSTER))
        try:
            time.sleep(p.settle_s)
            out["idle"] = _window(fl.url, reals, mirror, p.window_s)
            progress("fleet scale: etcd writes per member under drive")
            out["writes_per_member"] = _writes(fl, reals, mirror, p)
            biggest = max(p.members)
            for n in p.members:
                for period in p.periods if n == biggest else p.periods[:1]:
                    progress(f"fleet scale: {n} simulated members, load period {period:g} s")
                    ls = n == biggest and period == p.periods[0]
                    out["rows"].append(_row(fl, reals, mirror, n, period, p, ls))
        finally:
            mirror.close()
        out["python_start_s"] = python_start()
        out["first"] = []
        for prewarm in (False, True) if has_prewarm() else (False,):
            progress(f"fleet scale: first request to a newly joined D, prewarm {prewarm}")
            out["first"].append(first_requests(fl, p.joins, p.steady_requests, prewarm))
    return out


def report(rep: Report, m: dict[str, Any]) -> None:
    """The scale tables and targets of ``measure``'s figures."""
    idle = m["idle"]
    rows = [["0 (real P + D only)", "-", *_cells(idle)]]
    rows += [[str(r["members"]), fmt_num(r["period_s"], 0), *_cells(r)] for r in m["rows"]]
    rep.table(
        "registry events each real endpoint received, and its CPU, with simulated members under "
        "steady load (each member's load summary changes every load period)",
        ["members", "load period s", "events/s P", "events/s D", "counted by", "CPU % P",
         "CPU % D", "etcd req/s (all)"],
        rows,
        note="CPU: the endpoint's whole process while its data path is idle; the simulated "
        "members are one process (kvpush.commands.bench.fleet_sim)",
    )  # fmt: skip
    w = m["writes_per_member"]
    rep.table(
        "etcd requests per real member per second (drive through the pair at a steady rate)",
        ["method", "per member per s"],
        [[k, fmt_num(v, 3)] for k, v in w.items()] + [["total", fmt_num(sum(w.values()), 3)]],
    )
    ls_row = next((r for r in m["rows"] if "ls_s" in r), None)
    if ls_row is not None:
        ls = median(ls_row["ls_s"])
        beyond = ls - m["python_start_s"]
        rep.table(
            f"fleet ls --json with {ls_row['members'] + 2} endpoints registered",
            ["what", "seconds"],
            [
                ["kvpush fleet ls --json (process start to the listing)", fmt_num(ls)],
                ["kvpush --version (the interpreter and the CLI alone)",
                 fmt_num(m["python_start_s"])],
                ["list in process", fmt_num(ls_row["list_in_process_s"], 3)],
            ],
        )  # fmt: skip
        rep.target("fleet ls at the largest size, beyond interpreter start", "< 2 s",
                   f"{beyond:.2f} s", beyond < 2)  # fmt: skip
    _first_table(rep, m["first"])
    top = [r for r in m["rows"] if r["members"] == max(x["members"] for x in m["rows"])]
    worst = max(max(r["events_per_s"]) for r in m["rows"]) if m["rows"] else 0.0
    rep.target("registry events/s per endpoint with steady membership", "near 0 at every size",
               f"{worst:.1f}/s at most", worst < 1.0)  # fmt: skip
    rep.figures["scale"] = m
    rep.figures["scale_events_per_s_largest"] = [r["events_per_s"] for r in top]


def _first_table(rep: Report, modes: list[dict[str, Any]]) -> None:
    """The first request to a newly joined D per ``--prewarm`` mode (``fleet_first``), and the
    target on the ``--prewarm`` row."""
    rows = []
    for f in modes:
        first, steady = median(f["first_s"]), median(f["steady_p50_s"])
        rows.append([
            "on" if f["prewarm"] else "off", str(len(f["first_s"])), fmt_ms(first),
            fmt_ms(steady), fmt_x(ratio(first, steady)),
            fmt_ms(median(f.get("client_first_s") or [float("nan")])),
            fmt_ms(median(f.get("process_first_s") or [float("nan")])),
        ])  # fmt: skip
        if f["prewarm"]:
            rep.target("first request to a newly joined D, --prewarm", "within 1.5x steady p50",
                       fmt_x(ratio(first, steady)), ratio(first, steady) <= 1.5)  # fmt: skip
    rep.table(
        "first request to a newly joined D (3 s after it registered, from a router that serves "
        "the fleet: drive's Driver in the bench) vs the same router's steady p50 to that D",
        ["--prewarm", "joins", "first ms (median)", "steady p50 ms (median)", "first / p50",
         "a new client's first, warm pair ms", "a new drive process's first, warm pair ms"],
        rows,
        note="a new client's first: a new Driver in the bench process (its own sockets to P and "
        "D opened at that request); a new drive process's first: kvpush drive -n 1 (its "
        "interpreter's first calls too): both are the client's cost, not the endpoints'",
    )  # fmt: skip


def _cells(w: dict[str, Any]) -> list[str]:
    ev, cpu = w["events_per_s"], w["cpu_pct"]
    return [
        fmt_num(ev[0], 1), fmt_num(ev[1], 1), w["events_source"], fmt_num(cpu[0], 1),
        fmt_num(cpu[1], 1), fmt_num(sum(w["etcd"].values()), 1),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kvpush.commands.bench.render import render_text

    ap = argparse.ArgumentParser(prog="python -m kvpush.commands.bench.fleet_scale")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-out"))
    a = ap.parse_args(argv)
    p = QUICK_SCALE if a.quick else FULL_SCALE
    rep = Report("fleet", "fleet at scale: simulated members beside a real P and D", a.quick,
                 params=asdict(p))  # fmt: skip
    a.out_dir.mkdir(parents=True, exist_ok=True)
    m = measure(logs_dir(a.out_dir, "fleet-scale"), p, lambda s: print(s, file=sys.stderr))
    report(rep, m)
    result = rep.to_dict()
    result["command"] = "python -m kvpush.commands.bench.fleet_scale" + (
        " --quick" if a.quick else ""
    )
    (a.out_dir / "fleet-scale.json").write_text(json.dumps(result, indent=1) + "\n")
    print(render_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
