"""``drive --registry`` admits what it checked (issue 24, item 3): real etcd, real ``serve-*
--registry`` processes, drive as an operator runs it, bytes verified (drive's default).

Invariants: a D restarted at the same address with another geometry never gets a request (it is
left out with a note, no request fails ``incompatible``); stray records written straight into
etcd -- a closed port, an HTTP server, etcd's own client port, a stale P of another geometry
sorting first, a D record carrying a live P's address, 500 records of closed ports -- cost no
request and are each named once in the run's notes; records of silent listeners are checked
together (the run starts and every request is ok); a registry leave is a hint: every key
revoked under a running drive fails no request, and the endpoints (same incarnations) are taken
back once checked. No timing is asserted.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kvpush.config import Role
from kvpush.fleet.etcd import Etcd
from kvpush.fleet.record import EndpointRecord, Geometry, encode_member, member_key, members_prefix
from tests.conftest import SMALL, unused_port
from tests.support.drives import finish_drive, start_drive
from tests.support.etcd import EtcdServer
from tests.support.http_port import http_server
from tests.support.procs import Launcher, Proc
from tests.support.side import counters
from tests.support.silent_peers import SilentListener

pytestmark = pytest.mark.integration

CLUSTER = "adm"


def reg(etcd: EtcdServer) -> list[str]:
    return ["--registry", etcd.url, "--cluster", CLUSTER]


def start(serve: Launcher, etcd: EtcdServer, role: str, *args: str) -> Proc:
    return serve.start(role, *(args or SMALL), *reg(etcd), "--registry-ttl", "3")


def registered(etcd: EtcdServer) -> set[str]:
    e = Etcd(etcd.url)
    kvs, _ = e.get_prefix(members_prefix(CLUSTER))
    return {k.rsplit("/", 1)[1] for k, _ in kvs}


def wait_registered(etcd: EtcdServer, want: set[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not want <= registered(etcd):
        assert time.monotonic() < deadline, (want, registered(etcd))
        time.sleep(0.2)


def stray(role: Role, address: str, layers: int = 2) -> EndpointRecord:
    """A record nobody keeps alive (no lease): its key is its address."""
    return EndpointRecord(
        role=role,
        engine_id=f"stray-{address}",
        incarnation=f"stray-{address}",
        address=address,
        host="elsewhere",
        pid=1,
        tp_size=1,
        wire="kvpush",
        geometry=Geometry(
            num_blocks=64,
            layers=layers,
            regions=2 * layers,
            block_bytes=4096,
            dtype="bfloat16",
            kv_layout="NHD",
        ),
        compat_hash="stray",
        kvpush_version="0.1",
    )


def put(etcd: EtcdServer, records: list[EndpointRecord]) -> None:
    e = Etcd(etcd.url)
    for r in records:
        e.put(member_key(CLUSTER, r.address), encode_member(r))


def drive(etcd: EtcdServer, *args: str) -> subprocess.Popen[str]:
    return start_drive(*args, *reg(etcd))


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[dict[str, Any], str]:
    rep, err = finish_drive(proc, timeout)
    assert "Traceback" not in err, err
    return rep, err


def times_named(texts: list[str], address: str) -> int:
    """How often ``address`` is named in ``texts`` (127.0.0.1:50 is not in 127.0.0.1:5000)."""
    pattern = re.compile(re.escape(address) + r"(?!\d)")
    return sum(len(pattern.findall(t)) for t in texts)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ttl", ["3", "60"], ids=["key-lapses-first", "key-replaced"])
def test_a_d_restarted_with_another_geometry_never_gets_a_request(
    etcd: EtcdServer, serve: Launcher, ttl: str
) -> None:
    p = start(serve, etcd, "prefill")
    d1 = start(serve, etcd, "decode")
    # With a TTL of 3 s d2's key lapses before the new D registers (drive sees a leave, then a
    # join); with 60 s the new D's record replaces it (a restart).
    d2 = serve.start("decode", *SMALL, *reg(etcd), "--registry-ttl", ttl)
    wait_registered(etcd, {p.address, d1.address, d2.address})
    conc = 4
    run = drive(etcd, "-n", "600", "--rate", "40", "-c", str(conc), "--timeout", "10")
    deadline = time.monotonic() + 60  # d2 is in the rotation: it has answered some
    while counters(d2.address).get("requests_ok", 0) < 10:
        assert time.monotonic() < deadline and run.poll() is None, "d2 got no traffic"
        time.sleep(0.2)
    d2.kill()
    other = ["--num-blocks", "64", "--layers", "4", "--block-bytes", "4096"]
    d3 = start(serve, etcd, "decode", *other, "--port", str(d2.port))
    rep, err = finish(run)
    assert rep["requests"] == 600 and rep["ok"] + rep["failed"] == 600
    assert "incompatible" not in rep["failures_by_reason"], rep
    # Only what was in flight at d2 when it was killed failed (at most one per worker).
    assert rep["failed"] <= conc, rep
    assert set(rep["failures_by_reason"]) <= {"decode_unreachable", "peer_restarted"}, rep
    assert rep["verified"] == rep["ok"]
    c = counters(d3.address)
    assert c.get("requests_ok", 0) == 0 and c.get("requests_failed", 0) == 0, c
    # Said, with what differs, by the registry's check or the monitor's re-check.
    assert re.search(rf"decode {re.escape(d3.address)} .*layers 4 vs 2", err), err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stray_records_cost_no_request_and_are_each_named_once(
    etcd: EtcdServer, serve: Launcher
) -> None:
    p = start(serve, etcd, "prefill")
    d = start(serve, etcd, "decode")
    unregistered_p = serve.start("prefill", *SMALL)  # a live P, not in the registry
    wait_registered(etcd, {p.address, d.address})
    with http_server() as web_port:
        web = f"127.0.0.1:{web_port}"
        strays = [
            stray(Role.DECODE, f"127.0.0.1:{unused_port()}"),  # a closed port
            stray(Role.DECODE, web),  # an HTTP server
            stray(Role.DECODE, f"127.0.0.1:{etcd.client_port}"),  # etcd's own client port
            stray(Role.PREFILL, "127.0.0.1:1", layers=4),  # stale, sorts first, other geometry
            stray(Role.DECODE, unregistered_p.address),  # a D record carrying a live P's address
        ]
        stale = [stray(Role.DECODE, f"127.0.{k // 250 + 1}.{k % 250 + 1}:9") for k in range(500)]
        put(etcd, strays + stale)
        rep, err = finish(drive(etcd, "-n", "200", "-c", "4"))
    assert (rep["ok"], rep["failed"], rep["verified"]) == (200, 0, 200), (rep, err)
    assert rep["by_decode"] == {d.address: 200}, rep["by_decode"]
    notes = rep["notes"]
    for r in strays + stale:
        assert times_named(notes, r.address) == 1, (r.address, notes)
    assert times_named(notes, d.address) == 0
    said = "\n".join(notes)
    assert f"registry: decode {unregistered_p.address} left out: registered as decode, it is a " \
        "prefill" in said  # fmt: skip
    assert f"registry: decode {web} left out: answered but is not a kvpush" in said
    assert re.search(
        r"registry: 50\d registered endpoints do not answer \(connection refused\)", said
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_silent_records_are_checked_together_and_cost_no_request(
    etcd: EtcdServer, serve: Launcher
) -> None:
    p = start(serve, etcd, "prefill")
    d = start(serve, etcd, "decode")
    wait_registered(etcd, {p.address, d.address})
    with ExitStack() as stack:
        silent = [stack.enter_context(SilentListener()) for _ in range(20)]
        put(etcd, [stray(Role.DECODE, s.address) for s in silent])
        # One after another, 20 silent peers cost 20 x 5 s before the first request (and the
        # pytest timeout); checked together they cost a few of those.
        rep, err = finish(drive(etcd, "-n", "100", "-c", "4"), timeout=150)
        assert all(s.accepted >= 1 for s in silent)  # each one was contacted
    assert (rep["ok"], rep["failed"], rep["verified"]) == (100, 0, 100), (rep, err)
    assert rep["by_decode"] == {d.address: 100}, rep["by_decode"]
    for s in silent:
        assert times_named(rep["notes"], s.address) == 1, (s.address, rep["notes"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_registry_leave_is_a_hint_endpoints_that_come_back_are_taken_again(
    etcd: EtcdServer, serve: Launcher
) -> None:
    p = start(serve, etcd, "prefill")
    d = start(serve, etcd, "decode")
    wait_registered(etcd, {p.address, d.address})
    run = drive(etcd, "-n", "400", "--rate", "40", "-c", "4", "--peer-grace", "20")
    deadline = time.monotonic() + 60
    while counters(d.address).get("requests_ok", 0) < 20:
        assert time.monotonic() < deadline and run.poll() is None, "no traffic"
        time.sleep(0.2)
    # Every lease revoked (an etcd wipe, a lapse while the processes lived): both keys go;
    # the endpoints register again as the same incarnations.
    e = Etcd(etcd.url)
    for lease in _leases(etcd):
        e.revoke(lease)
    rep, err = finish(run)
    assert (rep["ok"], rep["failed"], rep["verified"]) == (400, 0, 400), (rep, err)
    assert f"registry: decode {d.address} left" in err, err
    assert f"registry: decode {d.address} is registered again: it takes requests" in err, err
    assert f"registry: prefill {p.address} is registered again: it takes requests" in err, err
    assert counters(d.address)["requests_ok"] >= 400


def _leases(etcd: EtcdServer) -> list[int]:
    """The ids of every lease etcd holds (its v3 JSON gateway)."""
    import urllib.request

    req = urllib.request.Request(etcd.url + "/v3/lease/leases", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        body = json.loads(r.read())
    ids = [int(x["ID"]) for x in body.get("leases", [])]
    assert ids, body
    return ids


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_d_that_joins_mid_run_has_its_phases_in_the_trace(
    etcd: EtcdServer, serve: Launcher, tmp_path: Path
) -> None:
    p = start(serve, etcd, "prefill")
    d1 = start(serve, etcd, "decode")
    wait_registered(etcd, {p.address, d1.address})
    trace = tmp_path / "trace.jsonl"
    n = 1200  # 20 s of requests: time enough for a D to start and join
    run = drive(etcd, "-n", str(n), "--rate", "60", "-c", "4", "--trace", str(trace))
    deadline = time.monotonic() + 60
    while counters(d1.address).get("requests_ok", 0) < 20:
        assert time.monotonic() < deadline and run.poll() is None, "no traffic"
        time.sleep(0.2)
    d2 = start(serve, etcd, "decode")  # joins mid-run
    while counters(d2.address).get("requests_ok", 0) < 20:
        assert time.monotonic() < deadline and run.poll() is None, "d2 got no traffic"
        time.sleep(0.2)
    rep, err = finish(run)
    assert (rep["ok"], rep["failed"]) == (n, 0), (rep, err)
    assert f"registry: decode {d2.address} joined: it takes requests" in err, err
    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(recs) == n and any(x["decode"] == d2.address for x in recs)
    for x in recs:  # the joiner's clock offset was measured when it joined: D's phases are in
        assert "phases_missing" not in x and "d_allocated" in x["phases"], x


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_p_whose_key_goes_costs_no_prefill_unreachable(etcd: EtcdServer, serve: Launcher) -> None:
    p1 = start(serve, etcd, "prefill")
    p2 = start(serve, etcd, "prefill")
    d = start(serve, etcd, "decode")
    wait_registered(etcd, {p1.address, p2.address, d.address})
    conc = 4
    run = drive(etcd, "-n", "500", "--rate", "50", "-c", str(conc))
    deadline = time.monotonic() + 60
    while counters(p2.address).get("pushes_ok", 0) < 10:
        assert time.monotonic() < deadline and run.poll() is None, "p2 got no traffic"
        time.sleep(0.2)
    assert p2.stop() == 0  # graceful: its record says leaving, its key goes, then it drains
    rep, err = finish(run)
    assert rep["ok"] + rep["failed"] == 500 and rep["verified"] == rep["ok"], rep
    assert f"registry: prefill {p2.address} left" in err, err
    # A request that picked p2 before drive heard it left goes to p1 (or waits for a P): none
    # fails as unreachable. One whose prefill leg p2 took as it began to drain may end
    # shutting_down (at most one per worker).
    assert "prefill_unreachable" not in rep["failures_by_reason"], rep
    assert rep["failed"] <= conc and set(rep["failures_by_reason"]) <= {"shutting_down"}, rep
