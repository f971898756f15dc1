"""``kvpush fleet ls|watch|check`` and ``drive --registry`` against a real etcd and real endpoints
registered with ``serve-* --registry`` (issue 15, items 2 and 3).

Every endpoint here is a ``python -m kvpush serve-*`` process that registers itself; every command
is the CLI as an operator runs it. Invariants: the listing is what the endpoints published; the
watch reports a join, a restart at the same port (new incarnation) and a leave; the check names an
incompatible pair's fields and a full D's reason while the good pair passes (exit 3); drive takes
a D that registers mid-run and loses only a killed D's requests in flight; etcd not answering is
one error, one hint, exit 69.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import SMALL, Done, run_cli, unused_port
from tests.support.etcd import EtcdServer
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env

pytestmark = pytest.mark.integration

CLUSTER = "t1"


def reg(etcd: EtcdServer) -> list[str]:
    return ["--registry", etcd.url, "--cluster", CLUSTER]


def start(serve: Launcher, etcd: EtcdServer, role: str, *args: str) -> Proc:
    return serve.start(role, *(args or SMALL), *reg(etcd))


def ls_json(etcd: EtcdServer) -> list[dict[str, Any]]:
    r = run_cli("fleet", "ls", "--json", *reg(etcd))
    assert r.returncode == 0, r.stderr
    out: list[dict[str, Any]] = json.loads(r.stdout)["endpoints"]
    return out


def wait_listed(
    etcd: EtcdServer, pred: Callable[[list[dict[str, Any]]], bool], timeout: float = 20.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        eps = ls_json(etcd)
        if pred(eps) or time.monotonic() > deadline:
            assert pred(eps), eps
            return eps
        time.sleep(0.3)


def addresses(eps: list[dict[str, Any]]) -> set[str]:
    return {e["address"] for e in eps}


def test_fleet_ls_shows_what_endpoints_registered(etcd: EtcdServer, serve: Launcher) -> None:
    p = start(serve, etcd, "prefill")
    d = start(serve, etcd, "decode")
    eps = wait_listed(etcd, lambda e: addresses(e) == {p.address, d.address})
    by = {e["address"]: e for e in eps}
    for proc, role in ((p, "prefill"), (d, "decode")):
        e = by[proc.address]
        assert e["role"] == role
        assert e["engine_id"] == proc.engine_id
        assert e["incarnation"] == proc.incarnation
        assert e["pid"] == proc.popen.pid
        assert e["num_blocks"] == 64 and e["tp_size"] == 1 and e["wire"] == "kvpush"
        assert e["health"] == "ok"
    r = run_cli("fleet", "ls", *reg(etcd))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    p_line = next(ln for ln in lines if p.address in ln)
    d_line = next(ln for ln in lines if d.address in ln)
    assert p_line.split()[0] == "P" and d_line.split()[0] == "D"
    assert p.incarnation[:8] in p_line and p.engine_id in p_line
    assert "cluster t1: 1 prefill, 1 decode" in r.stdout


def test_fleet_ls_empty_cluster_and_etcd_unreachable(etcd: EtcdServer) -> None:
    r = run_cli("fleet", "ls", "--registry", etcd.url, "--cluster", "nobody-here")
    assert r.returncode == 0 and "cluster 'nobody-here': no endpoint registered" in r.stdout
    r = run_cli("fleet", "ls", "--json", "--registry", etcd.url, "--cluster", "nobody-here")
    assert json.loads(r.stdout) == {"cluster": "nobody-here", "endpoints": [], "problems": []}
    dead = f"http://127.0.0.1:{unused_port()}"
    for cmd in (["fleet", "ls"], ["fleet", "check"], ["fleet", "watch", "--duration", "1"],
                ["drive", "-n", "1"]):  # fmt: skip
        r = run_cli(*cmd, "--registry", dead)
        assert r.returncode == 69, (cmd, r.stdout, r.stderr)
        assert len(r.err_lines) == 2, (cmd, r.stderr)
        assert r.err_lines[0].startswith("error: registry unavailable"), r.stderr
        assert r.err_lines[1].startswith(f"hint: is etcd running and reachable at {dead}?")
        assert "Traceback" not in r.stderr
    r = run_cli("fleet", "ls")
    assert r.returncode == 2 and r.err_lines[0] == "error: no registry given", r.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fleet_watch_reports_join_restart_leave(etcd: EtcdServer, serve: Launcher) -> None:
    p = start(serve, etcd, "prefill")
    wait_listed(etcd, lambda e: addresses(e) == {p.address})
    watch = subprocess.Popen(
        [*KVPUSH, "fleet", "watch", "--json", "--duration", "60", "--interval", "30", *reg(etcd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    lines: list[dict[str, Any]] = []

    def read() -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            lines.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_event(kind: str, address: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in list(lines):
                if ev.get("event") == kind and ev.get("address") == address:
                    return ev
            time.sleep(0.1)
        raise AssertionError(f"no {kind} of {address} in {lines}")

    try:
        deadline = time.monotonic() + 20
        while not lines and time.monotonic() < deadline:
            time.sleep(0.1)
        snap = lines[0]
        assert snap["event"] == "snapshot" and addresses(snap["endpoints"]) == {p.address}
        # A long lease: the killed D's key must outlive the start of its replacement.
        d = start(serve, etcd, "decode", *SMALL, "--registry-ttl", "120")
        joined = wait_event("join", d.address)
        assert joined["role"] == "decode" and joined["incarnation"] == d.incarnation
        # SIGKILL: the key stays until its lease lapses; a new D at the same port replaces it.
        d.kill()
        d2 = start(serve, etcd, "decode", *SMALL, "--port", str(d.port))
        assert d2.address == d.address and d2.incarnation != d.incarnation
        restarted = wait_event("restart", d.address)
        assert restarted["previous_incarnation"] == d.incarnation
        assert restarted["incarnation"] == d2.incarnation
        # A graceful stop removes the key at once.
        assert d2.stop() == 0
        left = wait_event("leave", d.address, timeout=10)
        assert left["incarnation"] == d2.incarnation
        kinds = [ev["event"] for ev in lines if ev.get("address") == d.address]
        assert kinds == ["join", "restart", "leave"], lines
    finally:
        watch.terminate()
        watch.wait(20)
    assert watch.returncode == 0, watch.stderr.read() if watch.stderr else ""


def _fill_pool(p: Proc, d: Proc, blocks: int, hold_s: float) -> None:
    """D allocates ``blocks`` for a request P never prefills: its pool is full for ``hold_s``."""
    from tests.support.fault_legs import run_leg

    t = threading.Thread(
        target=run_leg,
        args=("hold-the-pool", p.address, d.address, blocks),
        kwargs={"send_p": False, "deadline_s": hold_s, "d_timeout_s": hold_s + 10},
        daemon=True,
    )
    t.start()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fleet_check_names_incompatible_and_full_pairs(etcd: EtcdServer, serve: Launcher) -> None:
    p = start(serve, etcd, "prefill")
    good = start(serve, etcd, "decode")
    other = start(serve, etcd, "decode", "--num-blocks", "64", "--layers", "4",
                  "--block-bytes", "4096")  # fmt: skip
    full = start(serve, etcd, "decode")
    want = {p.address, good.address, other.address, full.address}
    wait_listed(etcd, lambda e: addresses(e) == want)
    _fill_pool(p, full, 64, hold_s=30.0)
    deadline = time.monotonic() + 10
    from tests.support.side import gauges

    while gauges(full.address)["pool_free"] != 0:
        assert time.monotonic() < deadline, gauges(full.address)
        time.sleep(0.1)

    r = run_cli("fleet", "check", "--json", "--size", "64KiB", "--deadline", "8", *reg(etcd))
    assert r.returncode == 3, (r.stdout, r.stderr)
    rep = json.loads(r.stdout)
    pairs = {x["decode"]: x for x in rep["pairs"]}
    assert pairs[good.address]["outcome"] == "ok", pairs[good.address]
    assert pairs[good.address]["pushes_ok"] == 3 and pairs[good.address]["blocks"] == 4
    assert pairs[good.address]["p50_ms"] > 0 and pairs[good.address]["gb_per_s"] > 0
    inc = pairs[other.address]
    assert inc["outcome"] == "incompatible"
    assert {d["field"] for d in inc["differences"]} == {"layers", "regions"}
    assert inc["differences"][0] == {"field": "layers", "prefill": 2, "decode": 4}
    bad = pairs[full.address]
    assert (bad["outcome"], bad["reason"]) == ("failed", "no_free_blocks"), bad
    assert rep["counts"] == {
        "ok": 1,
        "failed": 1,
        "incompatible": 1,
        "compatible": 0,
        "skipped": 0,
        "left": 0,
    }

    # The text form names the failing pair with its reason and the incompatible fields.
    r = run_cli("fleet", "check", "--size", "64KiB", "--deadline", "8", *reg(etcd))
    assert r.returncode == 3
    assert f"FAILED {p.address} -> {full.address}: no_free_blocks" in r.stdout
    assert f"INCOMPATIBLE {p.address} -> {other.address}: incompatible: layers 2 vs 4" in r.stdout
    assert "fleet check FAILED: 3 pairs (1 ok, 1 failed, 1 incompatible)" in r.stdout
    # --strict fails on the incompatible pair too; without the full D the rest passes.
    full.stop()  # graceful: its key goes first (the held request ends with the drain)
    wait_listed(etcd, lambda e: full.address not in addresses(e))
    r = run_cli("fleet", "check", "--size", "64KiB", *reg(etcd))
    assert r.returncode == 0, r.stdout
    assert "fleet check passed: 2 pairs (1 ok, 0 failed, 1 incompatible)" in r.stdout
    r = run_cli("fleet", "check", "--strict", "--size", "64KiB", *reg(etcd))
    assert r.returncode == 3, r.stdout


def _drive(etcd: EtcdServer, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KVPUSH, "drive", "--json", *args, *reg(etcd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=120)
    assert out.strip(), err
    return json.loads(out), err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_drive_registry_takes_a_joining_d_and_loses_only_a_killed_ds_requests(
    etcd: EtcdServer, serve: Launcher
) -> None:
    p = start(serve, etcd, "prefill")
    d1 = start(serve, etcd, "decode")
    wait_listed(etcd, lambda e: addresses(e) == {p.address, d1.address})
    n, rate, conc = 600, 40.0, 4  # 15 s of requests
    drive = _drive(etcd, "-n", str(n), "--rate", str(rate), "-c", str(conc), "--timeout", "10")
    time.sleep(3.0)
    d2 = start(serve, etcd, "decode")
    time.sleep(4.0)
    d1.kill()
    rep, err = _finish(drive)
    assert rep["requests"] == n and rep["ok"] + rep["failed"] == n
    assert rep["by_decode"].get(d2.address, 0) > 50, rep["by_decode"]
    assert f"registry: decode {d2.address} joined" in err
    # Only d1's requests already sent there when it died failed: at most one per worker (none
    # when no request was past its contact with d1: those went to d2).
    assert rep["failed"] <= conc, rep
    assert drive.returncode == (1 if rep["failed"] else 0), err
    assert set(rep["failures_by_reason"]) <= {"decode_unreachable"}, rep
    assert all(d1.address in f for f in rep["first_failures"]), rep["first_failures"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_drive_registry_stops_sending_to_a_d_whose_key_goes(
    etcd: EtcdServer, serve: Launcher
) -> None:
    p = start(serve, etcd, "prefill")
    d1 = start(serve, etcd, "decode")
    d2 = start(serve, etcd, "decode")
    wait_listed(etcd, lambda e: addresses(e) == {p.address, d1.address, d2.address})
    drive = _drive(etcd, "-n", "500", "--rate", "50", "-c", "4")  # 10 s of requests
    from tests.support.side import counters

    deadline = time.monotonic() + 60  # d2 is in the drive's rotation: it has answered some
    while counters(d2.address).get("requests_ok", 0) < 10:
        assert time.monotonic() < deadline and drive.poll() is None, "d2 got no traffic"
        time.sleep(0.2)
    assert d2.stop() == 0  # graceful: key removed first, then drains
    rep, err = _finish(drive)
    assert f"registry: decode {d2.address} left" in err
    assert 10 <= rep["by_decode"][d2.address] < rep["by_decode"][d1.address], rep["by_decode"]
    assert rep["ok"] + rep["failed"] == 500 and rep["verified"] == rep["ok"]
    # The key goes before the drain starts, but a request sent to d2 in the moment before drive
    # hears of it (a loaded host) finds d2 draining: at most one per worker, shutting_down, at d2.
    assert rep["failed"] <= 4, rep
    assert set(rep["failures_by_reason"]) <= {"shutting_down"}, rep
    assert all(d2.address in f for f in rep["first_failures"]), rep["first_failures"]
    assert drive.returncode == (0 if rep["failed"] == 0 else 1), (rep, err)


def test_drive_registry_refuses_explicit_endpoints_too(etcd: EtcdServer) -> None:
    r: Done = run_cli("drive", "-p", "127.0.0.1:1", "-d", "127.0.0.1:2", *reg(etcd))
    assert r.returncode == 2
    assert r.err_lines[0].startswith("error: --registry takes the Ps and Ds from the registry")
    r = run_cli("drive", *reg(etcd))
    assert r.returncode == 2
    assert r.err_lines[0] == f"error: no kvpush prefill endpoint registered in cluster '{CLUSTER}'"
