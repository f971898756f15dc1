"""Records are data (issue 24, item 5): the fleet tools draw what the registry holds without
obeying it, ``fleet check`` never fills a pool with its own pushes and never excuses a frozen
peer, and a D told that an HTTP port is its P says so at once.

Real etcd (``tests.support.etcd``), real endpoints (``serve-* --registry``), the CLI as an
operator runs it. A hostile record is written straight into etcd under the cluster's prefix
(its key's suffix is its address, as the registrar writes it): Rich markup, a terminal escape
and a newline that would forge a row. Invariants: the text forms show them escaped -- no raw
escape byte, no forged line -- and ``--json`` keeps them exact; ``--size 4MiB`` on 64-block pools
(one push fills a pool) passes every healthy pair; a D frozen (SIGSTOP) while its pair is under
way, whose lease then lapses, is a failed pair with its reason and exit 3 -- ``left`` needs the
data path's proof (its port refuses connections, or a new incarnation answers there); an HTTP
server named as P fails the D's request with "looks like HTTP", not after the side channel's 5 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import msgspec
import pytest

from kvpush.commands.common import control
from kvpush.commands.fleet.check import PairResult, settle_left
from kvpush.commands.fleet.proof import gone_proof
from kvpush.config import Role
from kvpush.fleet.etcd import Etcd
from kvpush.fleet.record import EndpointRecord, Geometry, encode_member, member_key
from kvpush.fleet.store import list_endpoints
from kvpush.wire import protocol
from tests.conftest import SMALL, run_cli, unused_port
from tests.integration.test_fleet_cli import addresses, ls_json, wait_listed
from tests.support.etcd import EtcdServer
from tests.support.http_port import http_server
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env
from tests.support.side import counters

pytestmark = pytest.mark.integration

CLUSTER = "t1"  # test_fleet_cli's helpers list this cluster
#: Markup, a screen-clearing escape, and a newline followed by what would pass for a row.
HOSTILE = "[bold red]x[/]\x1b[2J\nD 6.6.6.6:666 forged"
SHOWN = "[bold red]x[/]\\x1b[2J\\nD 6.6.6.6:666 forged"


def reg(etcd: EtcdServer) -> list[str]:
    return ["--registry", etcd.url, "--cluster", CLUSTER]


def start(serve: Launcher, etcd: EtcdServer, role: str, *args: str) -> Proc:
    return serve.start(role, *(args or SMALL), *reg(etcd))


def records(etcd: EtcdServer) -> dict[str, EndpointRecord]:
    recs, _ = list_endpoints(Etcd([etcd.url]), CLUSTER)
    return {r.address: r for r in recs}


def put_hostile_d(etcd: EtcdServer, like: EndpointRecord) -> str:
    """A D record (no process behind it) whose strings are hostile; its key ends in its
    address. Its dtype differs from P's, so ``fleet check`` names it and drives nothing."""
    addr = f"127.0.0.1:{unused_port()}"
    rec = msgspec.structs.replace(
        like,
        role=Role.DECODE,
        address=addr,
        host=HOSTILE,
        engine_id=HOSTILE,
        incarnation="forged-incarnation",
        compat_hash="forged",
        geometry=msgspec.structs.replace(like.geometry, dtype=HOSTILE),
    )
    Etcd([etcd.url]).put(member_key(CLUSTER, addr), encode_member(rec))
    return addr


def assert_escaped(text: str) -> None:
    assert "\x1b" not in text, text
    lines = text.splitlines()
    assert not any(ln.lstrip().startswith("D 6.6.6.6") for ln in lines), text
    assert SHOWN in text, text  # shown literally: markup not obeyed, escapes spelt out


@pytest.mark.timeout(180)
def test_hostile_record_is_shown_escaped_by_ls_check_and_watch(
    etcd: EtcdServer, serve: Launcher
) -> None:
    p = start(serve, etcd, "prefill")
    wait_listed(etcd, lambda e: addresses(e) == {p.address})
    watch = subprocess.Popen(
        [*KVPUSH, "fleet", "watch", "--duration", "20", "--interval", "1", *reg(etcd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(),
    )
    try:
        time.sleep(3.0)  # the watch has listed (P alone) and follows: the D is a join
        bad = put_hostile_d(etcd, records(etcd)[p.address])
        wait_listed(etcd, lambda e: bad in addresses(e))

        r = run_cli("fleet", "ls", *reg(etcd))
        assert r.returncode == 0, r.stderr
        assert_escaped(r.stdout)
        assert sum(1 for ln in r.stdout.splitlines() if bad in ln) == 1
        js = {e["address"]: e for e in ls_json(etcd)}
        assert js[bad]["host"] == HOSTILE and js[bad]["engine_id"] == HOSTILE  # exact

        r = run_cli("fleet", "check", "--size", "64KiB", *reg(etcd))
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert_escaped(r.stdout + r.stderr)
        assert f"INCOMPATIBLE {p.address} -> {bad}: incompatible: dtype bfloat16 vs {SHOWN}" in (
            r.stdout
        )
        r = run_cli("fleet", "check", "--json", "--size", "64KiB", *reg(etcd))
        pair = json.loads(r.stdout)["pairs"][0]
        assert pair["differences"][0]["decode"] == HOSTILE
    finally:
        out, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    text = out.decode()
    assert_escaped(text)
    joins = [ln for ln in text.splitlines() if " join decode " in ln]
    assert len(joins) == 1 and bad in joins[0] and f"({SHOWN})" in joins[0], text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_of_pushes_that_fill_a_pool_passes_every_healthy_pair(
    etcd: EtcdServer, serve: Launcher
) -> None:
    """4 MiB is 256 blocks of these pools, capped at the whole pool (64): two pairs at one P or
    one D at once would fill it; the check runs them one after the other instead."""
    eps = [start(serve, etcd, role) for role in ("prefill", "prefill", "decode", "decode")]
    wait_listed(etcd, lambda e: addresses(e) == {x.address for x in eps})
    r = run_cli("fleet", "check", "--json", "--size", "4MiB", "--pushes", "5", *reg(etcd),
                timeout=120)  # fmt: skip
    rep = json.loads(r.stdout)
    assert r.returncode == 0, (rep, r.stderr)
    assert rep["counts"]["ok"] == 4 and rep["counts"]["failed"] == 0, rep["pairs"]
    assert all(x["blocks"] == 64 and x["pushes_ok"] == 5 for x in rep["pairs"]), rep["pairs"]
    assert any("1 of its 2 pairs at a time" in n for n in rep["notes"]), rep["notes"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_d_frozen_mid_check_is_a_failed_pair_even_when_its_lease_lapses(
    etcd: EtcdServer, serve: Launcher
) -> None:
    p = start(serve, etcd, "prefill")
    ok = start(serve, etcd, "decode")
    frozen = start(serve, etcd, "decode", *SMALL, "--registry-ttl", "2")
    wait_listed(etcd, lambda e: addresses(e) == {p.address, ok.address, frozen.address})
    pushes = 200
    check = subprocess.Popen(
        [*KVPUSH, "fleet", "check", "--json", "--size", "64KiB", "--pushes", str(pushes),
         "--deadline", "30", "-c", "2", *reg(etcd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while counters(frozen.address).get("requests_ok", 0) < 3:  # its pair is under way
            assert time.monotonic() < deadline and check.poll() is None, "no push reached D"
            time.sleep(0.02)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        out, err = check.communicate(timeout=120)
        # The lease lapsed while it was frozen: the registry no longer lists it.
        assert frozen.address not in addresses(ls_json(etcd))
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
        if check.poll() is None:
            check.kill()
            check.wait(20)
    rep = json.loads(out)
    assert check.returncode == 3, (rep, err)
    pairs = {x["decode"]: x for x in rep["pairs"]}
    assert pairs[ok.address]["outcome"] == "ok", pairs[ok.address]
    bad = pairs[frozen.address]
    assert bad["outcome"] == "failed" and bad["reason"], bad
    assert bad["pushes_ok"] < pushes, bad  # frozen while its pushes were under way
    assert f"{frozen.address}: its key went, but it is not proven gone" in bad["detail"], bad
    assert rep["counts"]["left"] == 0 and rep["exit_status"] == 3


def test_left_needs_the_data_paths_proof(serve: Launcher) -> None:
    """``left`` only on proof: a port that refuses, or the new incarnation answering there."""
    d = serve.start("decode", *SMALL)
    answer = control.connect(d.address).identify()
    assert answer.kvpush is not None
    now_rec = msgspec.structs.replace(_record(d.address), incarnation=answer.kvpush.incarnation)
    assert gone_proof(d.address, now_rec, None) == (
        f"a new incarnation ({d.incarnation[:8]}) answers at {d.address}"
    )
    other = msgspec.structs.replace(now_rec, incarnation="someone-else")
    assert gone_proof(d.address, other, None) == ""  # it answers, as another incarnation
    assert gone_proof(d.address, None, None) == ""  # key gone, but it still accepts
    closed = f"127.0.0.1:{unused_port()}"
    assert gone_proof(closed, None, None) == f"{closed} refuses connections"

    before = {a: _record(a) for a in ("127.0.0.1:1", d.address, closed)}
    failed = PairResult("127.0.0.1:1", d.address, "failed", "deadline", "2 of 3 pushes")
    p_only = {"127.0.0.1:1": before["127.0.0.1:1"]}  # the registry after: both Ds' keys gone

    def proof(a: str) -> str:
        return gone_proof(a, None, None)

    kept = settle_left(failed, before, p_only, proof)
    assert kept.outcome == "failed"
    assert kept.detail == (
        f"2 of 3 pushes (registry: {d.address}: its key went, but it is not proven gone)"
    )
    gone = PairResult("127.0.0.1:1", closed, "failed", "decode_unreachable", "D: refused")
    left = settle_left(gone, before, p_only, proof)
    assert (left.outcome, left.detail) == (
        "left",
        f"{closed} refuses connections (decode_unreachable: D: refused)",
    )


def _record(address: str) -> EndpointRecord:
    return EndpointRecord(
        role=Role.DECODE, engine_id="e", incarnation="old", address=address, host="h", pid=1,
        tp_size=1, wire="kvpush", compat_hash="h", kvpush_version="0",
        geometry=Geometry(num_blocks=64, layers=2, regions=4, block_bytes=4096, dtype="bfloat16",
                          kv_layout="NHD"),
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_d_told_its_p_is_an_http_port_says_so_at_once(serve: Launcher) -> None:
    d = serve.start("decode", *SMALL)
    with http_server() as port, control.connect(d.address, None, 60) as c:
        rep = c.request(
            protocol.DecodeReq(
                transfer_id="http-as-p",
                prefill_host="127.0.0.1",
                prefill_port=port,
                num_blocks=1,
                deadline_s=30,
            ),
            timeout_s=60,
        )
    assert isinstance(rep, protocol.DecodeRep)
    assert (rep.outcome, rep.reason) == ("failed", "handshake_failed"), rep
    assert (
        f"127.0.0.1:{port} answered but is not a kvpush or vLLM side channel (looks like HTTP)"
        in rep.detail
    ), rep.detail
    assert d.proc.poll() is None
