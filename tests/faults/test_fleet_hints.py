"""A registry event is a hint, never proof (issue 24): real etcd, real ``serve-*`` processes, real
NIXL, verification on.

Invariants: a P frozen past its lease TTL under ``drive --registry`` corrupts nothing (no
``verify_failed``, D's ``unknown_completion`` 0, every request accounted for: those waiting on the
frozen P complete when it resumes); a registry delete of a live peer's key drops nothing (the
endpoints that hold it look at its side channel, find the same incarnation and keep it); a peer
that is really gone is still dropped, on its side channel's evidence; a record whose address is
not its key's is refused. No timing is asserted: the "eventually" loops have wide deadlines.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any

import pytest

from kvpush.fleet.etcd import Etcd
from kvpush.fleet.record import cluster_prefix, decode_member, member_key
from kvpush.fleet.store import list_endpoints
from tests.support.drives import finish_drive, start_drive
from tests.support.etcd import EtcdServer
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env
from tests.support.side import snapshot
from tests.support.waits import wait_for

pytestmark = [pytest.mark.integration]

CLUSTER = "hints"
# The issue's geometry: a D of 64 blocks, 2 layers, 64 KiB blocks; requests of 16 blocks.
GEOMETRY = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "65536"]


def reg(etcd: EtcdServer, ttl: int) -> list[str]:
    return ["--registry", etcd.url, "--cluster", CLUSTER, "--registry-ttl", str(ttl)]


def observer(etcd: EtcdServer) -> Etcd:
    """The test's own look at etcd. Patient (10 s a call, not the 2 s default): on a loaded host
    an etcd that just resumed, lost its prefix or restarted can take over 2 s to answer a range
    (seen with two test workers and a busy loop), and what these tests judge is the endpoints'
    and drive's behaviour, not how long this observer waits."""
    return Etcd([etcd.url], timeout_s=10.0)


def listed(e: Etcd) -> set[str]:
    return {r.address for r in list_endpoints(e, CLUSTER)[0]}


def counter(proc: Proc, name: str) -> int:
    snap = snapshot(proc.address)
    return int(snap["counters"].get(name, 0)) + int(snap["failures"].get(name, 0))


def holds(proc: Proc, engine_id: str) -> bool:
    rows = snapshot(proc.address)["peers"]
    return any(r["engine_id"] == engine_id and r["state"] != "down" for r in rows)


def hinted(proc: Proc) -> bool:
    return counter(proc, "registry_hints") >= 1


def settled(proc: Proc) -> bool:
    log = proc.log_text()
    return "kept (a lapsed lease" in log or "no longer suspected" in log


def drive(etcd: EtcdServer, *args: str) -> subprocess.Popen[str]:
    return start_drive("--registry", etcd.url, "--cluster", CLUSTER, *args)


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[dict[str, Any], str]:
    return finish_drive(proc, timeout)


def frozen_p_under_drive(
    etcd: EtcdServer, serve: Launcher, *, ttl: int, n: int, rate: int, at: float, freeze: float
) -> None:
    """Two Ps and one D, all registered; P1 frozen past its TTL while drive runs."""
    e = observer(etcd)
    p1 = serve.serve("prefill", *GEOMETRY, *reg(etcd, ttl))
    p2 = serve.serve("prefill", *GEOMETRY, *reg(etcd, ttl))
    d = serve.serve("decode", *GEOMETRY, *reg(etcd, ttl))
    wait_for(lambda: listed(e) == {p1.address, p2.address, d.address}, 30, "all registered")
    run = drive(etcd, "-n", str(n), "--blocks", "16", "-c", "4", "--rate", str(rate))
    # Freeze P1 with requests through it under way: D must hold it (drive's start-up and
    # preflight take their own time on a loaded host; ``at`` counts from D's first use of P1).
    wait_for(lambda: holds(d, p1.engine_id), 60, "D took requests through P1")
    time.sleep(at)
    os.kill(p1.popen.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: p1.address not in listed(e), ttl + 20, "P1's lease lapsed")
        # D held P1: the registry's word made it look, not drop (P1 does not answer: frozen).
        wait_for(lambda: "a hint, not proof" in d.log_text(), 15, "D looked at P1")
        time.sleep(max(0.0, freeze - ttl - 2))  # the rest of the freeze
        assert holds(d, p1.engine_id), "D dropped the frozen P on the registry's word"
    finally:
        os.kill(p1.popen.pid, signal.SIGCONT)
    rep, err = finish(run)
    assert rep["requests"] == n and rep["ok"] + rep["failed"] == n, rep
    reasons = rep["failures_by_reason"]
    assert "verify_failed" not in reasons and rep["verified"] == rep["ok"], (rep, err)
    # Nothing ended on the registry's word: what waited on P1 completed once it resumed (or,
    # at worst, ended by its deadline -- the data path's own evidence).
    assert set(reasons) <= {"deadline"}, (reasons, err)
    assert counter(d, "unknown_completion") == 0, snapshot(d.address)["failures"]
    assert counter(d, "registry_hints") >= 1
    wait_for(lambda: p1.address in listed(e), 20, "P1 registered again")
    for proc in (p1, p2, d):
        assert proc.popen.poll() is None


@pytest.mark.timeout(240)
def test_a_p_frozen_past_its_ttl_corrupts_nothing(etcd: EtcdServer, serve: Launcher) -> None:
    frozen_p_under_drive(etcd, serve, ttl=2, n=480, rate=40, at=2.0, freeze=7.0)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_p_frozen_past_its_ttl_corrupts_nothing_issue_scale(
    etcd: EtcdServer, serve: Launcher
) -> None:
    """The issue's run: 3,000 requests at 60/s, P1 frozen at 8 s for 16 s, TTL 10 s."""
    frozen_p_under_drive(etcd, serve, ttl=10, n=3000, rate=60, at=8.0, freeze=16.0)


@pytest.mark.timeout(180)
def test_a_registry_delete_of_a_live_peer_drops_nothing(etcd: EtcdServer, serve: Launcher) -> None:
    e = observer(etcd)
    p = serve.serve("prefill", *GEOMETRY, *reg(etcd, 10))
    d = serve.serve("decode", *GEOMETRY, *reg(etcd, 10))
    wait_for(lambda: listed(e) == {p.address, d.address}, 30, "both registered")
    rep, err = finish(drive(etcd, "-n", "20", "--blocks", "4"))
    assert rep["ok"] == 20, (rep, err)
    assert holds(d, p.engine_id) and holds(p, d.engine_id)
    evicted = (counter(d, "peers_evicted"), counter(p, "peers_evicted"))
    # Every key of the cluster deleted at once (an operator's `etcdctl del --prefix`).
    assert e.delete_prefix(cluster_prefix(CLUSTER)) == 4  # each one's membership and load
    # Each saw the other leave (a hint), looked, and kept it: the other answered with the same
    # incarnation, or put its key back (its registrar) before the look was done.
    for proc in (d, p):
        wait_for(functools.partial(hinted, proc), 30, "the hint noted")
        wait_for(functools.partial(settled, proc), 30, "the hint settled")
    wait_for(lambda: listed(e) == {p.address, d.address}, 20, "both registered again")
    assert (counter(d, "peers_evicted"), counter(p, "peers_evicted")) == evicted
    assert holds(d, p.engine_id) and holds(p, d.engine_id)
    rep, err = finish(drive(etcd, "-n", "20", "--blocks", "4"))
    assert rep["ok"] == 20, (rep, err)
    assert counter(d, "registry_hints_proven") == 0 == counter(p, "registry_hints_proven")


@pytest.mark.timeout(180)
def test_a_peer_that_is_really_gone_is_dropped_on_its_side_channels_word(
    etcd: EtcdServer, serve: Launcher
) -> None:
    e = observer(etcd)
    p = serve.serve("prefill", *GEOMETRY, *reg(etcd, 2))
    d = serve.serve("decode", *GEOMETRY, *reg(etcd, 2))
    wait_for(lambda: listed(e) == {p.address, d.address}, 30, "both registered")
    rep, err = finish(drive(etcd, "-n", "10", "--blocks", "4"))
    assert rep["ok"] == 10, (rep, err)
    assert holds(d, p.engine_id)
    p.kill()
    wait_for(lambda: counter(d, "registry_hints_proven") >= 1, 30, "D proved P gone")
    wait_for(lambda: not holds(d, p.engine_id), 15, "D dropped P")
    assert "its side channel confirms it" in d.log_text()


def test_a_record_whose_address_is_not_its_key_is_refused(
    etcd: EtcdServer, serve: Launcher
) -> None:
    e = observer(etcd)
    p = serve.serve("prefill", *GEOMETRY, *reg(etcd, 10))
    wait_for(lambda: listed(e) == {p.address}, 30, "P registered")
    raw = e.get(member_key(CLUSTER, p.address))
    assert raw is not None
    # A forged D record under another key, claiming P's address: it must not hide P.
    forged = json.loads(raw)
    forged["role"] = "decode"
    assert decode_member(json.dumps(forged).encode()).address == p.address
    e.put(member_key(CLUSTER, "127.0.0.1:1"), json.dumps(forged).encode())
    assert listed(e) == {p.address}
    r = subprocess.run(
        [*KVPUSH, "fleet", "ls", "--json", "--registry", etcd.url, "--cluster", CLUSTER],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    eps = json.loads(r.stdout)["endpoints"]
    assert [(x["address"], x["role"]) for x in eps] == [(p.address, "prefill")], eps


@pytest.mark.timeout(300)
def test_an_etcd_stall_a_wiped_prefix_and_an_empty_etcd_fail_no_request(
    etcd: EtcdServer, serve: Launcher
) -> None:
    """etcd frozen past every TTL (every lease expires when it resumes), then the prefix
    deleted, then etcd restarted on an empty data directory, all under ``drive --registry``:
    every endpoint is alive throughout, so no request fails and every endpoint is listed
    again."""
    e = observer(etcd)
    p = serve.serve("prefill", *GEOMETRY, *reg(etcd, 3))
    d1 = serve.serve("decode", *GEOMETRY, *reg(etcd, 3))
    d2 = serve.serve("decode", *GEOMETRY, *reg(etcd, 3))
    everyone = {p.address, d1.address, d2.address}
    wait_for(lambda: listed(e) == everyone, 30, "all registered")
    n = 1200
    run = drive(etcd, "-n", str(n), "--blocks", "4", "-c", "4", "--rate", "40")  # ~30 s
    time.sleep(3.0)
    etcd.freeze()
    time.sleep(6.0)  # past every TTL (3 s)
    etcd.thaw()
    wait_for(lambda: listed(e) == everyone, 30, "registered again after the stall")
    time.sleep(2.0)
    assert e.delete_prefix(cluster_prefix(CLUSTER)) >= 1
    wait_for(lambda: listed(e) == everyone, 30, "registered again after the wipe")
    time.sleep(2.0)
    etcd.kill()
    shutil.rmtree(etcd.data_dir)
    etcd.start()
    e = observer(etcd)
    wait_for(lambda: listed(e) == everyone, 40, "registered again in an empty etcd")
    rep, err = finish(run)
    assert (rep["requests"], rep["ok"], rep["failed"]) == (n, n, 0), (rep, err[-3000:])
    assert rep["verified"] == n
    for proc in (p, d1, d2):
        assert proc.popen.poll() is None
        assert counter(proc, "registry_hints_proven") == 0
        assert counter(proc, "peers_evicted") == 0, snapshot(proc.address)["counters"]
