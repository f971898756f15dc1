"""Every kvpush command that touches a real vLLM engine leaves it alive and untouched on NIXL.

What kills a vLLM peer (VLLM_INTEROP.md section 1): a side-channel message other than
``msgpack([b"get_meta_msg", pp, tp])`` from a REQ socket kills its listener thread; a NIXL
notification other than ``PUSH_REG:``/``HB:``/``<id>:<int>`` kills its engine. After each kvpush
command below, the vLLM peers it touched must still have their process, listener thread and
writer thread, no engine error, and (wire log) no NIXL activity at all: no notification sent
or received, no WRITE, no agent loaded. The module's vLLM peers see no vLLM traffic, so any
NIXL record is kvpush's doing. kvpush's own endpoints (``serve-prefill``/``serve-decode``) must
refuse the vLLM peers, naming them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Untouched, VllmPeer, start_many, stop_many

from tests.conftest import SMALL, Done, Served, ServeFactory
from tests.support.procs import wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]  # the first test starts the peers


@pytest.fixture(scope="module")
def endpoints(vllm_py: str, vllm_tmp: Path) -> Iterator[tuple[VllmPeer, VllmPeer, Served, Served]]:
    """The module's vLLM P and D and a real kvpush P and D (kvpush wire), all started at once
    (their start-ups overlap) and all stopped at the module's end."""
    serve = ServeFactory(vllm_tmp)
    peers: list[VllmPeer] = []
    try:
        kp = serve.start("prefill", *SMALL, wait=False)
        kd = serve.start("decode", *SMALL, wait=False)
        peers = start_many(
            [("P", vllm_tmp / "vllm-P", {}), ("D", vllm_tmp / "vllm-D", {})], python=vllm_py
        )
        wait_ready(kp, 120)
        wait_ready(kd, 120)
        yield peers[0], peers[1], kp, kd
    finally:
        stop_many(peers)
        serve.close()


@pytest.fixture(scope="module")
def vllm_pair(
    endpoints: tuple[VllmPeer, VllmPeer, Served, Served],
) -> tuple[VllmPeer, VllmPeer]:
    return endpoints[0], endpoints[1]


@pytest.fixture(scope="module")
def kvpush_pd(endpoints: tuple[VllmPeer, VllmPeer, Served, Served]) -> tuple[Served, Served]:
    return endpoints[2], endpoints[3]


@pytest.fixture
def untouched(vllm_p: VllmPeer, vllm_d: VllmPeer) -> Callable[[], Untouched]:
    return lambda: Untouched(vllm_p, vllm_d)


def check_probe_json(out: dict[str, Any], peer: VllmPeer) -> None:
    info, md = peer.info, out["metadata"]
    assert out["kind"] == "vllm"
    assert out["status"] == "healthy" and out["exit_status"] == 0
    assert out["compat_hash"] == info["compat_hash"]
    assert md["engine_id"] == info["engine_id"]
    assert md["block_lens"] == info["block_lens"]
    assert md["block_strides"] == info["block_strides"]
    assert md["num_blocks"] == info["num_blocks"]
    assert md["block_size"] == info["block_size"]
    assert md["kv_cache_layout"] == info["kv_cache_layout"] == "LBHNC"
    assert md["attn_backend_name"] == info["backend"]
    assert md["region_names"] == info["layer_names"]
    assert md["regions"] == len(info["layer_names"])
    assert md["kv_caches_base_addr"] == [hex(a) for a in info["kv_caches_base_addr"]]
    assert md["ranks"] == [[0, 0]]


PROBES = {
    "plain": [],
    "json": ["--json"],
    "stats": ["--stats"],
    "count10": ["--count", "10"],
    "handshake-notif": ["--handshake", "notif"],
    "handshake-full": ["--handshake", "full"],
    "geometry": [
        "--layers",
        "2",
        "--kv-regions",
        "per-layer",
        "--block-bytes",
        "8192",
        "--kv-layout",
        "LBHNC",
        "--dtype",
        "float32",
    ],
    "ranks00": ["--ranks", "0,0"],
}


@pytest.mark.parametrize("role", ["P", "D"])
@pytest.mark.parametrize("case", list(PROBES))
def test_probe(
    case: str,
    role: str,
    vllm_p: VllmPeer,
    vllm_d: VllmPeer,
    untouched: Callable[[], Untouched],
    kvpush_run: Callable[..., Done],
) -> None:
    peer = vllm_p if role == "P" else vllm_d
    watch = untouched()
    r = kvpush_run("probe", peer.address, *PROBES[case], timeout=120)
    watch.check(f"kvpush probe {' '.join(PROBES[case])}")
    assert r.returncode == 0, r.stdout + r.stderr
    if case == "json":
        check_probe_json(json.loads(r.stdout), peer)
        return
    lines = r.stdout.splitlines()
    assert lines[0] == f"vllm endpoint at {peer.address}: healthy", r.stdout
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines[1:] if ln.strip()}
    assert rows["engine_id"] == peer.engine_id
    assert rows["block_lens"] == str(peer.info["block_lens"])
    assert peer.info["compat_hash"] in r.stdout
    if case.startswith("handshake-"):
        # A real NIXL handshake from a tiny vLLM-wire endpoint: it loads the peer's agent (and,
        # full, its descriptors) and sends the peer nothing -- the wire check above says so.
        assert f"handshake ({case.split('-')[1]})" in r.stdout, r.stdout
    if case == "geometry":
        assert rows["compatible"] == "yes", r.stdout
    if case == "count10":
        assert "(10 samples)" in rows["rtt"]


def test_probe_handshake_json(
    vllm_p: VllmPeer, untouched: Callable[[], Untouched], kvpush_run: Callable[..., Done]
) -> None:
    watch = untouched()
    r = kvpush_run("probe", vllm_p.address, "--json", "--handshake", "full")
    watch.check("kvpush probe --json --handshake full")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    check_probe_json(out, vllm_p)
    assert out["handshake_mode"] == "full"
    assert set(out["handshake_timings_s"]) >= {"side_channel_s", "load_s", "prep_s", "total_s"}


@pytest.mark.parametrize("role", ["P", "D"])
def test_probe_ping_refused(
    role: str,
    vllm_p: VllmPeer,
    vllm_d: VllmPeer,
    untouched: Callable[[], Untouched],
    kvpush_run: Callable[..., Done],
) -> None:
    """NIXL pings are kvpush notifications, which kill a vLLM engine: refused, nothing sent."""
    peer = vllm_p if role == "P" else vllm_d
    watch = untouched()
    r = kvpush_run("probe", peer.address, "--ping", "3", timeout=120)
    watch.check("kvpush probe --ping 3")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.err_lines[0].startswith(f"error: not pinging {peer.address}: "), r.stderr
    assert r.err_lines[1].startswith("hint: drop --ping for a vLLM peer")


def check_refused(r: Done, vllm: VllmPeer) -> None:
    assert r.returncode == 3, r.stdout + r.stderr
    err = r.err_lines
    assert err and err[0].startswith(
        f"error: {vllm.address} is a vLLM NIXL side channel, not a kvpush endpoint"
    ), r.stderr
    assert "nothing but get_meta_msg was sent to it" in err[0]
    assert len(err) == 2 and err[1].startswith("hint:") and "--wire vllm" in err[1], r.stderr


def test_drive_refuses_vllm_prefill(
    vllm_p: VllmPeer,
    kvpush_pd: tuple[Served, Served],
    untouched: Callable[[], Untouched],
    kvpush_run: Callable[..., Done],
) -> None:
    _, kd = kvpush_pd
    watch = untouched()
    r = kvpush_run("drive", "-p", vllm_p.address, "-d", kd.address, "-n", "3", timeout=120)
    watch.check("kvpush drive -p VLLM_P -d KVPUSH_D")
    check_refused(r, vllm_p)


def test_drive_refuses_vllm_decode(
    vllm_d: VllmPeer,
    kvpush_pd: tuple[Served, Served],
    untouched: Callable[[], Untouched],
    kvpush_run: Callable[..., Done],
) -> None:
    kp, _ = kvpush_pd
    watch = untouched()
    r = kvpush_run("drive", "-p", kp.address, "-d", vllm_d.address, "-n", "3", timeout=120)
    watch.check("kvpush drive -p KVPUSH_P -d VLLM_D")
    check_refused(r, vllm_d)


def test_kvpush_decode_given_a_vllm_prefill(
    vllm_p: VllmPeer,
    kvpush_pd: tuple[Served, Served],
    untouched: Callable[[], Untouched],
    kvpush_run: Callable[..., Done],
) -> None:
    """A kvpush-wire D told (by mistake) to pull from a vLLM P: the decode leg fails naming the
    vLLM peer, the vLLM P gets nothing but get_meta_msg, and the kvpush D stays healthy.
    ``kvpush drive`` has no option to skip its preflight, so the leg is sent the way the
    driver sends it: kvpush's own side-channel client and ``DecodeReq``."""
    from kvpush.transport.client import SideChannelClient
    from kvpush.wire import protocol

    _, kd = kvpush_pd
    watch = untouched()
    with SideChannelClient("127.0.0.1", kd.port, timeout_s=30) as c:
        rep = c.request(
            protocol.DecodeReq(
                transfer_id="vllm-mistake-1",
                prefill_host=vllm_p.host,
                prefill_port=vllm_p.port,
                num_blocks=2,
                deadline_s=20,
            ),
            timeout_s=30,
        )
    watch.check("a kvpush D's decode leg naming the vLLM P")
    assert isinstance(rep, protocol.DecodeRep)
    assert rep.outcome == "failed" and rep.nbytes == 0, rep
    assert rep.reason == "incompatible", rep  # another wire: the compatibility kind
    assert rep.detail.startswith(
        f"{vllm_p.address} is a vLLM NIXL side channel, not a kvpush endpoint"
    ), rep
    r = kvpush_run("probe", kd.address, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "healthy", r.stderr


@pytest.mark.parametrize("vllm_role", ["P", "D"])
def test_driver_without_preflight(
    vllm_role: str,
    vllm_p: VllmPeer,
    vllm_d: VllmPeer,
    kvpush_pd: tuple[Served, Served],
    untouched: Callable[[], Untouched],
) -> None:
    """The router library with its preflight off (``DriveConfig(preflight=False)``; the CLI has
    no such option): each leg meant for a vLLM peer fails on kvpush's first-contact check, as
    ``incompatible`` (the wire differs)."""
    from kvpush.commands.drive.driver import DriveConfig, Driver

    kp, kd = kvpush_pd
    vllm = vllm_p if vllm_role == "P" else vllm_d
    prefill, decode = (vllm.address, kd.address) if vllm_role == "P" else (kp.address, vllm.address)
    watch = untouched()
    cfg = DriveConfig(
        prefill=(prefill,),
        decode=(decode,),
        requests=2,
        concurrency=1,
        blocks=2,
        timeout_s=20,
        preflight=False,
    )
    report = Driver(cfg).run()
    watch.check(f"Driver(preflight=False) with the vLLM {vllm_role}")
    assert (report.ok, report.failed) == (0, 2), report
    # A vLLM peer where kvpush was expected is a WrongWireError, an IncompatiblePeerError:
    # the closed Failure set names it ``incompatible`` (kvpush.commands.common.reasons), on either
    # leg.
    assert list(report.failures_by_reason) == ["incompatible"], report.failures_by_reason
    assert all(f"{vllm.address} is a vLLM NIXL side channel" in f for f in report.first_failures)
