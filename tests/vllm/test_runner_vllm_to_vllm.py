"""vLLM P -> vLLM D through the runner: both sides are vLLM's own NixlPushConnector.

This is the reference the kvpush interop tests stand on: if vLLM cannot push to vLLM through
``peer.py``, nothing measured against these peers means anything. Bytes are compared by sha256
(P: what it filled, D: what landed, both computed in the peers) and against the digest this
process computes from the pattern's definition (``pattern_sha256``). Both orders of a push-mode
router are covered, and a D that allocates after P's lease would have run out, kept alive by
vLLM's heartbeats only. The module's peers run with a 6 s lease (heartbeat every 1 s, each
extending the lease to now + 4 s).
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import VllmPeer, pattern_sha256, request_ids, router_params

LEASE_S = 6

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]  # the first test starts the peers


@pytest.fixture(scope="module")
def vllm_lease() -> int:
    return LEASE_S


def check_push(
    p: VllmPeer,
    d: VllmPeer,
    pres: dict[str, Any],
    dres: dict[str, Any],
    p_id: str,
    d_id: str,
    p_blocks: list[int],
    d_blocks: list[int],
) -> None:
    assert pres.get("finished") is True, pres
    assert pres["lease_expired"] is False, pres
    assert dres["ok"] is True and dres["failed"] is False and dres["timed_out"] is False, dres
    # The WRITE vLLM posted went to this D request, block for block.
    assert pres["write"] == {
        "request_id": p_id,
        "d_engine_id": d.engine_id,
        "d_request_id": d_id,
        "local_block_ids": [p_blocks],
        "remote_block_ids": [d_blocks],
    }
    assert pres["sha256"] == pattern_sha256(p.info, pres["seed"], p_blocks)
    assert dres["sha256"] == pres["sha256"]
    for peer in (p, d):
        peer.assert_alive("a push")


def test_p_finishes_before_d_registers(vllm_p: VllmPeer, vllm_d: VllmPeer) -> None:
    p_id, d_id = request_ids("pfirst")
    p_blocks, d_blocks = [1, 3, 5], [2, 4, 6]
    cid = vllm_p.prefill(p_id, p_blocks)
    params = vllm_p.result(cid, suffix=".params")["params"]
    assert params["remote_engine_id"] == vllm_p.engine_id
    assert params["remote_request_id"] == p_id
    assert params["remote_port"] == vllm_p.port
    assert params["transfer_mode"] == "push"
    dcid = vllm_d.decode(d_id, params, d_blocks)
    check_push(
        vllm_p, vllm_d, vllm_p.result(cid), vllm_d.result(dcid), p_id, d_id, p_blocks, d_blocks
    )


def test_d_registers_before_p_finishes(vllm_p: VllmPeer, vllm_d: VllmPeer) -> None:
    p_id, d_id = request_ids("dfirst")
    p_blocks, d_blocks = [0, 7, 2, 9], [11, 3, 8, 1]  # not sorted: order is part of the mapping
    mark = vllm_p.wire_mark()
    dcid = vllm_d.decode(d_id, router_params(vllm_p, p_id), d_blocks)
    # P holds its request open until D's PUSH_REG is pending in vLLM's writer.
    cid = vllm_p.prefill(p_id, p_blocks, order="d_first")
    pres, dres = vllm_p.result(cid), vllm_d.result(dcid)
    check_push(vllm_p, vllm_d, pres, dres, p_id, d_id, p_blocks, d_blocks)
    wire = vllm_p.wire(mark)
    reg_at = [
        i
        for i, r in enumerate(wire)
        if r["kind"] == "recv_notif" and r["msg"]["type"] == "PUSH_REG"
    ]
    write_at = [i for i, r in enumerate(wire) if r["kind"] == "push_write"]
    assert len(reg_at) == 1 and len(write_at) == 1, wire
    reg = wire[reg_at[0]]["msg"]["payload"]
    assert reg["request_id"] == d_id and reg["local_block_ids"] == [d_blocks]
    assert reg_at[0] < write_at[0]


def test_heartbeats_keep_the_lease_past_its_end(vllm_p: VllmPeer, vllm_d: VllmPeer) -> None:
    """D allocates 8 s after P finished, beyond P's 6 s lease: only D's heartbeats (every
    lease // 6 s from on_new_request on) keep P's blocks. A request no D asks for is the control:
    its lease runs out in the same window and vLLM reports it sent with no WRITE."""
    p_id, d_id = request_ids("hb")
    lone_id, _ = request_ids("lone")
    p_blocks, d_blocks, lone_blocks = [4, 6], [5, 7], [12, 13]
    alloc_delay = LEASE_S + 2.0
    mark = vllm_p.wire_mark()
    lone = vllm_p.prefill(lone_id, lone_blocks)
    cid = vllm_p.prefill(p_id, p_blocks)
    params = vllm_p.result(cid, suffix=".params")["params"]
    dcid = vllm_d.decode(d_id, params, d_blocks, alloc_delay=alloc_delay)
    pres, dres = vllm_p.result(cid), vllm_d.result(dcid)
    check_push(vllm_p, vllm_d, pres, dres, p_id, d_id, p_blocks, d_blocks)
    assert pres["seconds"] > LEASE_S  # the WRITE came after the lease would have ended
    assert dres["seconds"] >= alloc_delay
    hbs = [
        r["msg"]["raw"]
        for r in vllm_p.wire(mark)
        if r["kind"] == "recv_notif" and r["msg"]["type"] == "HB"
    ]
    assert len(hbs) >= 3 and all(p_id in hb.split(":", 1)[1].split(",") for hb in hbs), hbs

    control = vllm_p.result(lone)
    assert control["finished"] is True
    assert control["lease_expired"] is True and control["write"] is None, control
    assert control["seconds"] >= LEASE_S - 0.5
    assert {r["request_id"] for r in vllm_p.wire(mark) if r["kind"] == "lease_expired"} == {lone_id}
