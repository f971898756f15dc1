"""A vLLM P restarted at the same address under a kvpush D heals, and a kvpush P restarted under
a vLLM D (issue 16, item 2).

vLLM's own connector (scheduler and worker, real NIXL, CPU tensors) runs the P; kvpush's D
(``serve-decode --wire vllm --like P``) receives its pushes. The P is SIGKILLed and started
again at the same port, as a new engine (a new engine id, a new NIXL agent); the router hands
D the new P's ``kv_transfer_params``. D must drop the old engine's agent before it loads the new
one and send nothing through it (``stale_agents_removed``, ``stale_agent_uses`` = 0, one remote
agent loaded), and the push from the new P lands intact.

The reverse: kvpush's P (``serve-prefill --wire vllm --like D``) pushes into vLLM's own D, is
SIGKILLed and started again at the same port (a new engine id and NIXL agent); vLLM's D is handed
the new P's ``kv_transfer_params`` and the push lands intact, with vLLM's D alive throughout (what
vLLM does with the dead engine's agent is vLLM's; kvpush only has to answer as a new engine).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from harness import VllmPeer, pattern_sha256, request_ids

from kvpush.commands.common.ports import free_port
from kvpush.commands.leg.legs import decode_leg, prefill_leg
from tests.conftest import ServeFactory
from tests.support.legs import stats
from tests.support.procs import wait_ready

LEASE_S = 6

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _push(p: VllmPeer, d_address: str, tag: str, blocks: list[int]) -> None:
    p_id, _ = request_ids(tag)
    cid = p.prefill(p_id, blocks)
    params = p.result(cid, suffix=".params")["params"]
    rep = decode_leg(d_address, params, None, timeout_s=60)
    pres = p.result(cid)
    assert rep.outcome == "ok", rep
    assert rep.sha256 == pres["sha256"] == pattern_sha256(p.info, pres["seed"], blocks)


def test_vllm_p_restarted_under_a_kvpush_d(vllm_py: str, vllm_tmp: Path) -> None:
    serve = ServeFactory(vllm_tmp)
    p = VllmPeer.start("P", vllm_tmp / "vllm-P", python=vllm_py, lease=LEASE_S)
    p2: VllmPeer | None = None
    try:
        d = serve.start(
            "decode", "--wire", "vllm", "--like", p.address, "--num-blocks", "16",
            "--heartbeat", "1", "--lease", str(LEASE_S), wait=False,
        )  # fmt: skip
        wait_ready(d, 120)
        _push(p, d.address, "restart-before", [1, 3, 5])
        old_engine = p.engine_id
        p.kill()
        p2 = VllmPeer.start("P", vllm_tmp / "vllm-P2", python=vllm_py, lease=LEASE_S, port=p.port)
        assert p2.address == p.address and p2.engine_id != old_engine
        _push(p2, d.address, "restart-after", [2, 4, 6])
        snap = stats(d.address)
        c, g = snap["counters"], snap["gauges"]
        assert isinstance(c, dict) and isinstance(g, dict)
        assert c.get("stale_agents_removed", 0) >= 1, c
        assert g["stale_agent_uses"] == 0, g
        assert g["remote_agents"] == 1, g
        log = d.log_text()
        assert 0 <= log.find("removed the agent") < log.rfind(" done in "), log[-3000:]
        p2.assert_alive("vLLM P restarted under kvpush D")
    finally:
        serve.close()
        for peer in (p, p2):
            if peer is not None:
                peer.kill()


def _push_into(d: VllmPeer, p_address: str, tag: str, d_blocks: list[int]) -> str:
    """One request prefilled by the kvpush P at ``p_address`` into vLLM's D; P's engine id."""
    p_id, d_id = request_ids(tag)
    dres: dict[str, Any] = {}
    runner: list[threading.Thread] = []

    def on_params(params: dict[str, Any]) -> None:
        cmd = {"op": "decode", "request_id": d_id, "params": params, "blocks": d_blocks}
        t = threading.Thread(target=lambda: dres.update(d.command(cmd)))
        t.start()
        runner.append(t)

    rep = prefill_leg(p_address, p_id, len(d_blocks), 60, on_params=on_params)
    for t in runner:
        t.join(120)
    assert rep.outcome == "ok", rep
    assert dres["ok"] is True and dres["failed"] is False, dres
    assert dres["sha256"] == rep.sha256, (dres, rep)
    return str(rep.kv_transfer_params["remote_engine_id"])


def test_kvpush_p_restarted_under_a_vllm_d(vllm_py: str, vllm_tmp: Path) -> None:
    serve = ServeFactory(vllm_tmp)
    d = VllmPeer.start("D", vllm_tmp / "vllm-D", python=vllm_py, lease=LEASE_S)
    try:
        args = (
            "--wire", "vllm", "--like", d.address, "--num-blocks", "16", "--heartbeat", "1",
            "--lease", str(LEASE_S), "--port", str(free_port()),
        )  # fmt: skip
        p = serve.start("prefill", *args, wait=False)
        wait_ready(p, 120)
        before = _push_into(d, p.address, "krestart-before", [9, 2, 5])
        p.kill()
        p.popen.wait(30)
        p2 = serve.start("prefill", *args, wait=False)
        wait_ready(p2, 120)
        assert p2.address == p.address
        after = _push_into(d, p2.address, "krestart-after", [4, 7, 1])
        assert after != before  # vLLM's D met a new engine at the same address
        d.assert_alive("kvpush P restarted under vLLM D")
    finally:
        serve.close()
        d.kill()
