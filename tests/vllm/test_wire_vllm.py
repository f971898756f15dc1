"""kvpush standing in for either side of a vLLM push deployment, against vLLM's own connector.

* vLLM P -> kvpush D (``serve-decode --wire vllm --like VLLM_P``): the decode leg carries the
  ``kv_transfer_params`` vLLM's ``request_finished`` returned; D registers with vLLM's P in
  vLLM's form, vLLM's P does its *full* handshake of kvpush's D (its metadata must pass vLLM's
  full validation) and WRITEs. The sha256 D reports equals vLLM's digest of what it filled, and
  this process's own digest of the pattern -- in both router orders, and with D holding its
  request past P's lease (kvpush's heartbeats keep it alive).
* kvpush P -> vLLM D (``serve-prefill --wire vllm --like VLLM_D``): the prefill leg returns the
  ``kv_transfer_params``; vLLM's D registers, does its full handshake of kvpush's P, receives
  the WRITE and its completion, and the bytes that landed hash like what kvpush filled.
* a compatibility-hash mismatch fails the decode leg with ``incompatible``, naming both hashes,
  and sends vLLM's P nothing but ``get_meta_msg``.
* the same two flows through the CLI, as an operator runs them: ``kvpush leg decode --decode
  <kvpush D> --kv-transfer-params <what vLLM's P returned>`` and ``kvpush leg prefill --prefill
  <kvpush P> --request-id ID --blocks N``, whose first stdout line is handed to vLLM's D.

After each, the vLLM peers are alive (process, listener, writer, no engine error) and every
notification they received was one of vLLM's three forms. The module's vLLM peers run with a
6 s lease; kvpush's D heartbeats every second.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    Untouched,
    VllmPeer,
    pattern_sha256,
    request_ids,
    router_params,
    start_many,
    stop_many,
)

from kvpush.commands.leg.legs import LegReport, decode_leg, prefill_leg
from tests.conftest import Served, ServeFactory
from tests.support.procs import KVPUSH, clean_env, wait_reading_stdin, wait_ready

LEASE_S = 6

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]  # the first test starts the peers


@pytest.fixture(scope="module")
def vllm_lease() -> int:
    return LEASE_S


@pytest.fixture(scope="module")
def stand_ins(vllm_py: str, vllm_tmp: Path) -> Iterator[tuple[VllmPeer, VllmPeer, ServeFactory]]:
    peers: list[VllmPeer] = []
    serve = ServeFactory(vllm_tmp)
    try:
        peers = start_many(
            [
                ("P", vllm_tmp / "vllm-P", {"lease": LEASE_S}),
                ("D", vllm_tmp / "vllm-D", {"lease": LEASE_S}),
            ],
            python=vllm_py,
        )
        yield peers[0], peers[1], serve
    finally:
        serve.close()
        stop_many(peers)


@pytest.fixture(scope="module")
def vllm_pair(stand_ins: tuple[VllmPeer, VllmPeer, ServeFactory]) -> tuple[VllmPeer, VllmPeer]:
    return stand_ins[0], stand_ins[1]


def _kvpush(serve: ServeFactory, role: str, like: VllmPeer, *extra: str) -> Served:
    s = serve.start(
        role,
        "--wire",
        "vllm",
        "--like",
        like.address,
        "--num-blocks",
        "16",
        "--heartbeat",
        "1",
        "--lease",
        str(LEASE_S),
        *extra,
        wait=False,
    )
    wait_ready(s, 120)
    return s


@pytest.fixture(scope="module")
def kvpush_d(stand_ins: tuple[VllmPeer, VllmPeer, ServeFactory]) -> Served:
    return _kvpush(stand_ins[2], "decode", stand_ins[0])


@pytest.fixture(scope="module")
def kvpush_p(stand_ins: tuple[VllmPeer, VllmPeer, ServeFactory]) -> Served:
    return _kvpush(stand_ins[2], "prefill", stand_ins[1])


def vllm_forms_only(peer: VllmPeer, mark: int) -> None:
    """Every notification the vLLM peer received since ``mark`` is one of vLLM's forms."""
    for r in peer.wire(mark):
        if r["kind"] == "recv_notif":
            assert r["msg"]["type"] in ("PUSH_REG", "HB", "completion"), r


def check_landed(rep: LegReport, pres: dict[str, Any], p: VllmPeer, blocks: list[int]) -> None:
    assert rep.outcome == "ok", rep
    assert pres["finished"] is True and pres["lease_expired"] is False, pres
    assert rep.sha256 == pres["sha256"] == pattern_sha256(p.info, pres["seed"], blocks)
    assert rep.nbytes == len(blocks) * sum(p.info["block_lens"])


# ------------------------------------------------------------------ vLLM P -> kvpush D


def test_vllm_p_to_kvpush_d_p_first(vllm_p: VllmPeer, kvpush_d: Served) -> None:
    p_id, _ = request_ids("v2k-pfirst")
    blocks = [1, 3, 5]
    mark = vllm_p.wire_mark()
    cid = vllm_p.prefill(p_id, blocks)
    params = vllm_p.result(cid, suffix=".params")["params"]
    rep = decode_leg(kvpush_d.address, params, None, timeout_s=60)
    check_landed(rep, vllm_p.result(cid), vllm_p, blocks)
    assert rep.request_id.rsplit("-", 1)[0] == p_id.rsplit("-", 1)[0]  # shares P's base id
    write = vllm_p.result(cid)["write"]
    assert write["d_request_id"] == rep.request_id and write["local_block_ids"] == [blocks]
    vllm_forms_only(vllm_p, mark)
    vllm_p.assert_alive("vLLM P -> kvpush D")


def test_vllm_p_to_kvpush_d_d_first(vllm_p: VllmPeer, kvpush_d: Served) -> None:
    p_id, _ = request_ids("v2k-dfirst")
    blocks = [6, 0, 2]
    out: list[LegReport] = []
    t = threading.Thread(
        target=lambda: out.append(
            decode_leg(kvpush_d.address, router_params(vllm_p, p_id), len(blocks), 60)
        )
    )
    t.start()
    cid = vllm_p.prefill(p_id, blocks, order="d_first")  # waits until D's PUSH_REG is pending
    pres = vllm_p.result(cid)
    t.join(90)
    check_landed(out[0], pres, vllm_p, blocks)
    vllm_p.assert_alive("vLLM P -> kvpush D, D first")


def test_kvpush_d_heartbeats_keep_vllm_p_lease(vllm_p: VllmPeer, kvpush_d: Served) -> None:
    """D holds its request 8 s before it gets blocks, past P's 6 s lease: only kvpush's HB:
    notifications keep vLLM's P from dropping the blocks."""
    p_id, _ = request_ids("v2k-hb")
    blocks = [4, 7]
    mark = vllm_p.wire_mark()
    cid = vllm_p.prefill(p_id, blocks)
    params = vllm_p.result(cid, suffix=".params")["params"]
    hold = LEASE_S + 2.0
    rep = decode_leg(kvpush_d.address, params, None, timeout_s=60, alloc_delay_s=hold)
    pres = vllm_p.result(cid)
    check_landed(rep, pres, vllm_p, blocks)
    assert pres["seconds"] > LEASE_S
    hbs = [
        r["msg"]["raw"]
        for r in vllm_p.wire(mark)
        if r["kind"] == "recv_notif" and r["msg"]["type"] == "HB"
    ]
    assert len(hbs) >= 3 and all(p_id in hb[3:].split(",") for hb in hbs), hbs
    vllm_forms_only(vllm_p, mark)


def test_compat_hash_mismatch_names_both_hashes(
    vllm_p: VllmPeer, stand_ins: tuple[VllmPeer, VllmPeer, ServeFactory]
) -> None:
    wrong = "0" * 64
    d = _kvpush(stand_ins[2], "decode", vllm_p, "--compat-hash", wrong)
    watch = Untouched(vllm_p)
    p_id, _ = request_ids("v2k-hash")
    rep = decode_leg(d.address, router_params(vllm_p, p_id), 2, timeout_s=20)
    assert rep.outcome == "failed" and rep.reason == "incompatible", rep
    assert wrong in rep.detail and vllm_p.info["compat_hash"] in rep.detail, rep.detail
    watch.check("a kvpush D with another compatibility hash")  # get_meta_msg only
    d.stop()


# ------------------------------------------------------------------ kvpush P -> vLLM D


def test_kvpush_p_to_vllm_d(vllm_d: VllmPeer, kvpush_p: Served) -> None:
    p_id, d_id = request_ids("k2v")
    d_blocks = [9, 2, 5]
    mark = vllm_d.wire_mark()
    dres: dict[str, Any] = {}

    def hand_to_d(params: dict[str, Any]) -> None:
        dres.update(
            vllm_d.command(
                {"op": "decode", "request_id": d_id, "params": params, "blocks": d_blocks}
            )
        )

    runner: list[threading.Thread] = []

    def on_params(params: dict[str, Any]) -> None:
        t = threading.Thread(target=hand_to_d, args=(params,))
        t.start()
        runner.append(t)

    rep = prefill_leg(kvpush_p.address, p_id, len(d_blocks), 60, on_params=on_params)
    runner[0].join(120)
    assert rep.outcome == "ok", rep
    assert dres["ok"] is True and dres["failed"] is False, dres
    assert dres["sha256"] == rep.sha256, (dres, rep)
    assert rep.kv_transfer_params["remote_request_id"] == p_id
    recv = [r for r in vllm_d.wire(mark) if r["kind"] == "recv_notif"]
    assert [r["msg"]["raw"] for r in recv] == [f"{d_id}:1"], recv  # one completion, vLLM's form
    loads = [r for r in vllm_d.wire(mark) if r["kind"] == "add_remote_agent"]
    assert loads, "vLLM's D loaded kvpush's agent (its handshake passed full validation)"
    vllm_d.assert_alive("kvpush P -> vLLM D")


# ------------------------------------------------------------------ the same through the CLI


def test_cli_decode_leg_from_vllm_p(vllm_p: VllmPeer, kvpush_d: Served, tmp_path: Path) -> None:
    """What a router does with a vLLM P's answer, by hand: the params as vLLM returned them,
    piped in. The leg is started first, and P is asked to prefill only once the leg waits on
    its stdin: P's lease here is LEASE_S (6 s), and a CLI that is still starting when P has
    finished spends part of it starting (under load, all of it: seen with one CPU-bound process
    beside the suite, 4.5 s to start and 2.3 s to reach D; P then drops the request and D's leg
    ends at its deadline, as vLLM's lease says)."""
    p_id, _ = request_ids("cli-v2k")
    blocks = [2, 6]
    mark = vllm_p.wire_mark()
    leg = subprocess.Popen(
        [*KVPUSH, "leg", "decode", "--decode", kvpush_d.address, "--kv-transfer-params", "-",
         "--json"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(),
    )  # fmt: skip
    wait_reading_stdin(leg)
    cid = vllm_p.prefill(p_id, blocks)
    params = json.dumps(vllm_p.result(cid, suffix=".params")["params"])
    stdout, stderr = leg.communicate(params, timeout=120)
    assert leg.returncode == 0, stdout + stderr
    out = json.loads(stdout)
    pres = vllm_p.result(cid)
    assert out["outcome"] == "ok" and out["leg"] == "decode", out
    assert out["sha256"] == pres["sha256"] == pattern_sha256(vllm_p.info, pres["seed"], blocks)
    assert out["nbytes"] == len(blocks) * sum(vllm_p.info["block_lens"])
    vllm_forms_only(vllm_p, mark)
    vllm_p.assert_alive("kvpush drive --decode")


def test_cli_prefill_leg_into_vllm_d(vllm_d: VllmPeer, kvpush_p: Served) -> None:
    """The first stdout line of ``drive --prefill`` is what vLLM's D is given, unchanged."""
    p_id, d_id = request_ids("cli-k2v")
    d_blocks = [11, 4]
    mark = vllm_d.wire_mark()
    proc = subprocess.Popen(
        [
            *KVPUSH,
            "leg",
            "prefill",
            "--prefill",
            kvpush_p.address,
            "--request-id",
            p_id,
            "--blocks",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=clean_env(),
    )
    assert proc.stdout is not None
    params = json.loads(proc.stdout.readline())
    dres = vllm_d.command(
        {"op": "decode", "request_id": d_id, "params": params, "blocks": d_blocks}
    )
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, out + err
    assert dres["ok"] is True and dres["failed"] is False, dres
    sha = next(ln.split()[1] for ln in out.splitlines() if ln.startswith("sha256"))
    assert out.splitlines()[0] == "prefill leg  ok"
    assert dres["sha256"] == sha
    recv = [r for r in vllm_d.wire(mark) if r["kind"] == "recv_notif"]
    assert [r["msg"]["raw"] for r in recv] == [f"{d_id}:1"], recv
    vllm_d.assert_alive("kvpush drive --prefill")
