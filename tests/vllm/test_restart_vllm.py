"""A vLLM P restarted at the same address under a kvpush D heals (issue 16, item 2).

vLLM's own connector (scheduler and worker, real NIXL, CPU tensors) runs the P; kvpush's D
(``serve-decode --wire vllm --like P``) receives its pushes. The P is SIGKILLed and started
again at the same port, as a new engine (a new engine id, a new NIXL agent); the router hands
D the new P's ``kv_transfer_params``. D must drop the old engine's agent before it loads the new
one and send nothing through it (``stale_agents_removed``, ``stale_agent_uses`` = 0, one remote
agent loaded), and the push from the new P lands intact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import VllmPeer, pattern_sha256, request_ids

from kvpush.ops.vllm_legs import decode_leg
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
