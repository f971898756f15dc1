"""Layout v2 (issue 27): membership apart from load, and warm pairs. Real etcd, real ``serve-*``
processes, real NIXL, verification on.

Invariants: under ``drive --registry`` a registered endpoint's own registry watch receives
nothing while every load summary changes (``registry_watch_events`` flat); a join, a restart and
a leave still reach every endpoint, and a restarted peer's stale agent is still released on the
side channel's proof. ``--prewarm``: a D that joins an idle cluster is handshaken by the P (and
the D by it) before any request, so the first request starts no handshake, and the D ran its
own request path once before it was ready; a D that refuses is tried again, counted and shown
in the P's peer table, and pushes to the others go on. No timing is asserted: the "eventually"
loops have wide deadlines.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import msgspec
import pytest

from kvpush.fleet.etcd import Etcd
from kvpush.fleet.record import (
    decode_member,
    encode_member,
    load_key,
    member_key,
)
from kvpush.fleet.store import list_endpoints
from tests.conftest import unused_port
from tests.support.drives import finish_drive, start_drive
from tests.support.etcd import EtcdServer
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env
from tests.support.side import snapshot
from tests.support.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CLUSTER = "layout"
SMALL = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "4096"]


def reg(etcd: EtcdServer, *more: str) -> list[str]:
    return ["--registry", etcd.url, "--cluster", CLUSTER, "--registry-ttl", "3", *more]


def listed(e: Etcd) -> set[str]:
    return {r.address for r in list_endpoints(e, CLUSTER)[0]}


def counter(proc: Proc, name: str) -> int:
    return int(snapshot(proc.address)["counters"].get(name, 0))


def rows(proc: Proc, address: str) -> list[dict[str, Any]]:
    """``proc``'s peer-table rows of the endpoint at ``address`` (every rank)."""
    return [
        r
        for r in snapshot(proc.address)["peers"]
        if r["peer"] == address or str(r["peer"]).startswith(f"{address} rank ")
    ]


def connected(proc: Proc, address: str, mode: str | None = None) -> bool:
    got = rows(proc, address)
    return bool(got) and all(
        r["state"] == "connected" and (mode is None or r["mode"] == mode) for r in got
    )


def drive(*args: str) -> tuple[dict[str, Any], str]:
    return finish_drive(start_drive(*args), 240)


def test_a_registered_endpoints_watch_stays_flat_while_load_summaries_change(
    etcd: EtcdServer, serve: Launcher
) -> None:
    e = Etcd([etcd.url])
    fast = ("--registry-load-period", "0.2")  # a load summary up to five times a second
    p = serve.serve("prefill", *SMALL, *reg(etcd, *fast))
    d = serve.serve("decode", *SMALL, *reg(etcd, *fast))
    wait_for(lambda: listed(e) == {p.address, d.address}, 30, "both registered")
    wait_for(lambda: counter(p, "registry_watch_events") >= 1, 30, "P saw D join")
    time.sleep(1.0)
    before = (counter(p, "registry_watch_events"), counter(d, "registry_watch_events"))
    run = start_drive(
        "--registry", etcd.url, "--cluster", CLUSTER, "-n", "300", "-c", "2", "--blocks", "4",
        "--rate", "50",
    )  # fmt: skip
    summaries: set[bytes] = set()
    while run.poll() is None:
        raw = e.get(load_key(CLUSTER, d.address))
        if raw is not None:
            summaries.add(raw)
        time.sleep(0.1)
    rep, err = finish_drive(run)
    assert (rep["ok"], rep["verified"]) == (300, 300), (rep, err[-2000:])
    assert len(summaries) >= 3, "D's load summary did not change while drive ran"
    after = (counter(p, "registry_watch_events"), counter(d, "registry_watch_events"))
    assert after == before  # not one of those load writes reached an endpoint's own watch


def test_join_restart_and_leave_reach_every_endpoint_and_a_stale_agent_is_released(
    etcd: EtcdServer, serve: Launcher
) -> None:
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd))
    d1 = serve.serve("decode", *SMALL, *reg(etcd))
    wait_for(lambda: listed(e) == {p.address, d1.address}, 30, "both registered")
    wait_for(lambda: counter(p, "registry_watch_events") >= 1, 30, "P saw D1 join")

    def seen(n: tuple[int, int]) -> bool:
        return counter(p, "registry_watch_events") > n[0] and (
            counter(d1, "registry_watch_events") > n[1]
        )

    def now() -> tuple[int, int]:
        return counter(p, "registry_watch_events"), counter(d1, "registry_watch_events")

    # A join reaches both.
    n0 = now()
    port = unused_port()
    d2 = serve.serve("decode", "--port", str(port), *SMALL, *reg(etcd))
    wait_for(lambda: seen(n0), 30, "the join reached P and D1")
    rep, err = drive("-p", p.address, "-d", d2.address, "-n", "5", "--blocks", "4")
    assert rep["ok"] == 5, (rep, err[-2000:])
    assert connected(p, d2.address)
    # A restart at the same address reaches both; P, which held the old D2, proves it on the
    # side channel (another incarnation answers) and releases its stale agent.
    n1 = now()
    stale = counter(p, "stale_agents_removed")
    d2.kill()
    d2b = serve.serve("decode", "--port", str(port), *SMALL, *reg(etcd))
    wait_for(lambda: seen(n1), 30, "the restart reached P and D1")
    wait_for(lambda: counter(p, "registry_hints_proven") >= 1, 30, "P proved the restart")
    wait_for(lambda: counter(p, "stale_agents_removed") > stale, 30, "the old agent released")
    rep, err = drive("-p", p.address, "-d", d2b.address, "-n", "5", "--blocks", "4")
    assert rep["ok"] == 5, (rep, err[-2000:])
    # A leave reaches both.
    n2 = now()
    d2b.stop()
    wait_for(lambda: seen(n2), 30, "the leave reached P and D1")
    wait_for(lambda: listed(e) == {p.address, d1.address}, 30, "D2 gone from the registry")


def test_prewarm_handshakes_a_joining_d_before_any_request(
    etcd: EtcdServer, serve: Launcher
) -> None:
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd, "--prewarm"))
    wait_for(lambda: listed(e) == {p.address}, 30, "P registered")
    d = serve.serve("decode", *SMALL, *reg(etcd, "--prewarm"))
    # No request yet: P's table holds D (full: what its WRITEs need), D's holds P.
    wait_for(lambda: connected(p, d.address, "full"), 30, "P handshook D")
    wait_for(lambda: connected(d, p.address), 30, "D handshook P")
    assert counter(p, "prewarms") >= 1 and counter(d, "prewarms") >= 1
    assert "before any request" in p.log_text()
    # D's own request path (the completer's verification and digest) ran once before it was
    # ready: said in its stats and its log (kvpush.decode.warmup).
    assert snapshot(d.address)["info"].get("warmup") == "request path"
    assert "request path warmed before ready" in d.log_text()
    started = (counter(p, "handshakes_started"), counter(d, "handshakes_started"))
    rep, err = drive("-p", p.address, "-d", d.address, "-n", "3", "--blocks", "4")
    assert (rep["ok"], rep["verified"]) == (3, 3), (rep, err[-2000:])
    # The first request found the pair connected: it started no handshake on either side.
    assert (counter(p, "handshakes_started"), counter(d, "handshakes_started")) == started


def test_prewarm_retries_a_refusing_d_shows_it_and_pushes_to_others_go_on(
    etcd: EtcdServer, serve: Launcher
) -> None:
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd, "--prewarm"))
    d1 = serve.serve("decode", *SMALL, *reg(etcd))
    wait_for(lambda: connected(p, d1.address, "full"), 30, "P warmed D1")
    assert "warmup" not in snapshot(d1.address)["info"]  # a D without --prewarm: not warmed
    # A compatible D's record whose port refuses connections (nothing listens there yet).
    port = unused_port()
    ghost = f"127.0.0.1:{port}"
    raw = e.get(member_key(CLUSTER, d1.address))
    assert raw is not None
    like = decode_member(raw)
    forged = msgspec.structs.replace(
        like, address=ghost, incarnation="not-yet", engine_id="d-ghost", pid=1
    )
    e.put(member_key(CLUSTER, ghost), encode_member(forged))
    wait_for(lambda: counter(p, "prewarms_failed") >= 2, 60, "the warm-up tried again")
    assert f"prewarm: decode {ghost} not handshaken (try 1)" in p.log_text()
    row = rows(p, ghost)
    assert row and row[0]["state"] == "failed" and row[0]["last_error"], row
    # Pushes to D1 meanwhile: every one verified.
    rep, err = drive("-p", p.address, "-d", d1.address, "-n", "40", "-c", "2", "--blocks", "4")
    assert (rep["ok"], rep["verified"]) == (40, 40), (rep, err[-2000:])
    # A real D comes up there (it registers: a new incarnation at that address): warmed.
    warmed = counter(p, "prewarms")
    d2 = serve.serve("decode", "--port", str(port), *SMALL, *reg(etcd))
    wait_for(lambda: connected(p, d2.address, "full"), 60, "P warmed the D once it answered")
    assert counter(p, "prewarms") > warmed


def test_fleet_check_warm_leaves_every_pair_handshaken(etcd: EtcdServer, serve: Launcher) -> None:
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd))
    d1 = serve.serve("decode", *SMALL, *reg(etcd))
    d2 = serve.serve("decode", *SMALL, *reg(etcd))
    wait_for(lambda: listed(e) == {p.address, d1.address, d2.address}, 30, "all registered")
    r = subprocess.run(
        [*KVPUSH, "fleet", "check", "--warm", "--json", "--size", "8KiB", "--pushes", "2",
         "--registry", etcd.url, "--cluster", CLUSTER],
        capture_output=True, text=True, env=clean_env(), timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    warm = json.loads(r.stdout)["warm"]
    assert (warm["warm"], warm["cold"]) == (2, 0), warm
    for d in (d1, d2):
        assert connected(p, d.address, "full") and connected(d, p.address)
