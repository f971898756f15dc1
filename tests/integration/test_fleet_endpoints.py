"""``fleet ls|check|watch --endpoints FILE`` and ``--peer``: a fleet listed by hand, no etcd.

Real ``serve-*`` processes, real NIXL, the CLI as an operator runs it. Invariants: a listed P and
two listed Ds, one of another geometry -- the check passes the good pair with verified pushes and
names the bad pair's field; every bad entry of the listing (an unreadable file, a line that is no
address, a duplicate, an HTTP server where a side channel should be, a closed port) is one
``warning:`` line and the rest goes on; a listed endpoint that cannot be seen makes the check exit
3; ``fleet watch`` reports a listed D that died (its port refuses: proof) as a ``leave`` and its
return as a ``join``.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL, run_cli, unused_port
from tests.support.http_port import http_server
from tests.support.procs import KVPUSH, Launcher, clean_env, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

OTHER = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "8192"]


def warnings_of(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning: ")]


def test_check_a_listed_fleet_names_the_bad_pair(serve: Launcher, tmp_path: Path) -> None:
    p = serve.start("prefill", *SMALL, wait=False)
    d = serve.start("decode", *SMALL, wait=False)
    d_other = serve.start("decode", *OTHER)
    wait_ready(p)
    wait_ready(d)
    listing = tmp_path / "fleet.txt"
    listing.write_text(
        f"# P and two Ds\n{p.address} prefill\n{d.address}   # role from the endpoint\n"
        f'{{"address": "{d_other.address}", "role": "decode"}}\n'
    )
    r = run_cli("fleet", "check", "--endpoints", str(listing), "--json", "--pushes", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["prefills"] == [p.address]
    assert sorted(rep["decodes"]) == sorted([d.address, d_other.address])
    by_d = {x["decode"]: x for x in rep["pairs"]}
    good, bad = by_d[d.address], by_d[d_other.address]
    assert good["outcome"] == "ok" and good["pushes_ok"] == 2, good
    assert bad["outcome"] == "incompatible", bad
    assert [f["field"] for f in bad["differences"]] == ["block_bytes"], bad
    assert rep["problems"] == [] and rep["unseen"] == 0

    text = run_cli("fleet", "check", "--endpoints", str(listing), "--pushes", "1")
    assert text.returncode == 0, text.stdout + text.stderr
    want = f"INCOMPATIBLE {p.address} -> {d_other.address}: incompatible: block_bytes 4096 vs 8192"
    assert want in text.stdout


def test_bad_listing_lines_are_one_warning_each(serve: Launcher, tmp_path: Path) -> None:
    p = serve.start("prefill", *SMALL, wait=False)
    d = serve.start("decode", *SMALL)
    wait_ready(p)
    closed = unused_port()
    with http_server() as http_port:
        listing = tmp_path / "fleet.txt"
        listing.write_text(
            f"{p.address} prefill\n"
            "no-port-here\n"
            f"{d.address} decode\n"
            f"{d.address}\n"
            f"127.0.0.1:{http_port} decode\n"
            f"127.0.0.1:{closed} decode\n"
            f"{d.address.split(':')[0]}:1 router\n"
        )
        missing = tmp_path / "missing.txt"
        r = run_cli(
            "fleet", "check", "--endpoints", str(listing), "--endpoints", str(missing),
            "--pushes", "1",
        )  # fmt: skip
    warns = warnings_of(r.stderr)
    assert len(warns) == 6, r.stderr
    joined = "\n".join(warns)
    assert f"{missing}: cannot read the endpoint list" in joined
    assert "fleet.txt:2: address 'no-port-here' has no port: line ignored" in joined
    assert f"fleet.txt:4: {d.address} is listed again (" in joined
    assert f"127.0.0.1:{http_port}: answered but is not a kvpush or vLLM side channel" in joined
    assert f"127.0.0.1:{closed}: unreachable (connection refused)" in joined
    assert "fleet.txt:7: unknown role 'router': line ignored" in joined
    assert "Traceback" not in r.stderr
    # the rest went on: the good pair was pushed through; two listed endpoints were not seen
    assert "fleet check passed: 1 pairs (1 ok, 0 failed)" in r.stdout, r.stdout
    assert r.returncode == 3, r.stdout + r.stderr
    assert "2 listed endpoint(s) could not be seen" in r.stderr


def test_ls_of_many_listed_endpoints_and_peers(serve: Launcher, tmp_path: Path) -> None:
    p = serve.start("prefill", *SMALL, wait=False)
    d = serve.start("decode", *SMALL)
    wait_ready(p)
    dead: set[int] = set()
    while len(dead) < 40:  # 40 different closed ports (a draw may repeat one)
        dead.add(unused_port())
    listing = tmp_path / "fleet.txt"
    listing.write_text("".join(f"127.0.0.1:{port} decode\n" for port in sorted(dead)))
    r = run_cli(
        "fleet", "ls", "--endpoints", str(listing), "--peer", f"{p.address}=prefill",
        "--peer", d.address, "--json", "-c", "16",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {e["address"]: e["role"] for e in out["endpoints"]} == {
        p.address: "prefill",
        d.address: "decode",
    }
    assert len(out["problems"]) == 40 and all("unreachable" in x for x in out["problems"])


def test_watch_sees_a_listed_decode_die_and_return(serve: Launcher, tmp_path: Path) -> None:
    p = serve.start("prefill", *SMALL, wait=False)
    port = unused_port()
    d = serve.start("decode", *SMALL, "--port", str(port))
    wait_ready(p)
    cmd = [
        *KVPUSH, "fleet", "watch", "--peer", f"{p.address}=prefill", "--peer", d.address,
        "--json", "--duration", "40",
    ]  # fmt: skip
    w = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=clean_env())  # fmt: skip
    try:
        assert w.stdout is not None
        snap = json.loads(w.stdout.readline())
        assert snap["event"] == "snapshot"
        first = {e["address"]: e["incarnation"] for e in snap["endpoints"]}
        assert d.address in first, snap
        d.kill()
        events = _read_until(w, "leave", d.address)
        assert events[-1]["incarnation"] == first[d.address]
        d2 = serve.start("decode", *SMALL, "--port", str(port))
        join = _read_until(w, "join", d2.address)[-1]
        assert join["incarnation"] != first[d.address]
    finally:
        w.terminate()
        w.wait(10)


def _read_until(w: subprocess.Popen[str], kind: str, address: str) -> list[dict[str, object]]:
    assert w.stdout is not None
    seen: list[dict[str, object]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = w.stdout.readline()
        if not line:
            break
        ev = json.loads(line)
        seen.append(ev)
        if ev.get("event") == kind and ev.get("address") == address:
            return seen
    raise AssertionError(f"no {kind} of {address} in {seen}")


def test_check_names_each_pair_lane(serve: Launcher) -> None:
    """The lane column: P's own word (from UCX's report) on the transport of its WRITEs -- a D
    restricted to TCP on P's host is flagged, a default D rides shared memory."""
    p = serve.start("prefill", *SMALL, wait=False)
    d_tcp = serve.start("decode", *SMALL, wait=False, env=clean_env(UCX_TLS="tcp"))
    d_shm = serve.start("decode", *SMALL, wait=False)
    for proc in (p, d_tcp, d_shm):
        wait_ready(proc)
    # one pair at a time: the two Ds' UCX configs are told apart by the first contact each
    r = run_cli(
        "fleet", "check", "--peer", p.address, "--peer", d_tcp.address, "--peer",
        d_shm.address, "--json", "--pushes", "2", "-c", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    by_d = {x["decode"]: x for x in json.loads(r.stdout)["pairs"]}
    tcp, shm = by_d[d_tcp.address], by_d[d_shm.address]
    assert tcp["lane"].startswith("tcp") and tcp["lane_flags"] == ["tcp_on_one_host"], tcp
    assert shm["lane"] in ("cma", "posix", "sysv", "xpmem", "knem"), shm
    assert shm["lane_flags"] == [], shm
