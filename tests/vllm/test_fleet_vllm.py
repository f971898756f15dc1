"""``fleet check --endpoints`` across vLLM 0.33's own engines (``NixlPushConnector``) and kvpush.

The listing: a vLLM P and a vLLM D of one geometry, a vLLM D of another (64-token blocks: twice
the block length), and a kvpush P standing in for a vLLM P (``serve-prefill --wire vllm --like``
the vLLM D). Invariants:

* the matrix names every incompatible pair with its fields (``block_bytes``, read from each side's
  own ``NixlAgentMetadata``), and the compatible vLLM pair says ``compatible (metadata)``: only
  a vLLM router can start its push;
* the kvpush P -> vLLM D pair is ``compatible (metadata)`` too, and that verdict is true: the
  test, playing the vLLM D's router, pushes through the pair and the sha256 is equal on both
  sides;
* the check sends a vLLM engine nothing but ``get_meta_msg``: every vLLM listener, writer and
  engine is alive afterwards, with no NIXL activity at all from the check (``Untouched``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Untouched, VllmPeer, request_ids, start_many, stop_many

from kvpush.commands.leg.legs import prefill_leg
from kvpush.transport.contact import tcp_contact
from tests.conftest import Served, ServeFactory, run_cli
from tests.support.procs import wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def fleet(vllm_py: str, vllm_tmp: Path) -> Iterator[tuple[list[VllmPeer], Served]]:
    serve = ServeFactory(vllm_tmp)
    peers: list[VllmPeer] = []
    try:
        peers = start_many(
            [
                ("P", vllm_tmp / "vllm-P", {}),
                ("D", vllm_tmp / "vllm-D", {}),
                ("D", vllm_tmp / "vllm-D64", {"extra": ["--block-size", "64"]}),
            ],
            python=vllm_py,
        )
        kp = serve.start(
            "prefill", "--wire", "vllm", "--like", peers[1].address, "--num-blocks", "16",
            wait=False,
        )  # fmt: skip
        wait_ready(kp, 120)
        yield peers, kp
    finally:
        serve.close()
        stop_many(peers)


def test_fleet_check_across_vllm_engines(
    fleet: tuple[list[VllmPeer], Served], tmp_path: Path
) -> None:
    (vp, vd, vd64), kp = fleet
    listing = tmp_path / "fleet.txt"
    listing.write_text(
        f"# vLLM engines say no role: the listing does\n{vp.address} prefill\n"
        f"{vd.address} decode\n{vd64.address} decode tp=1\n{kp.address}\n"
    )
    untouched = Untouched(vp, vd, vd64)
    r = run_cli("fleet", "check", "--endpoints", str(listing), "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr + _state_of(vp, vd, vd64, kp)
    rep = json.loads(r.stdout)
    assert rep["problems"] == [] and rep["unseen"] == 0, rep
    assert sorted(rep["prefills"]) == sorted([vp.address, kp.address])
    pairs = {(x["prefill"], x["decode"]): x for x in rep["pairs"]}

    vllm_pair = pairs[(vp.address, vd.address)]
    assert (vllm_pair["outcome"], vllm_pair["reason"]) == ("compatible", "metadata"), vllm_pair
    assert "only a vLLM router can start their push" in vllm_pair["detail"]
    for p in (vp, kp):
        bad = pairs[(p.address, vd64.address)]
        assert bad["outcome"] == "incompatible", bad
        fields = {f["field"]: (f["prefill"], f["decode"]) for f in bad["differences"]}
        lens = vd.info["block_lens"][0]
        assert fields == {"block_bytes": (lens, 2 * lens)}, bad
    stand_in = pairs[(kp.address, vd.address)]
    assert (stand_in["outcome"], stand_in["reason"]) == ("compatible", "metadata"), stand_in

    text = run_cli("fleet", "check", "--endpoints", str(listing), timeout=120)
    assert text.returncode == 0, text.stdout + text.stderr + _state_of(vp, vd, vd64, kp)
    assert "compatible (metadata)" in text.stdout
    assert f"INCOMPATIBLE {vp.address} -> {vd64.address}: incompatible: block_bytes" in (
        text.stdout
    )
    untouched.check("fleet check --endpoints")

    # The verdict holds: as the vLLM D's router, push through the kvpush P -> vLLM D pair.
    p_id, d_id = request_ids("fleet")
    dres: dict[str, Any] = {}
    runner: list[threading.Thread] = []

    def on_params(params: dict[str, Any]) -> None:
        cmd = {"op": "decode", "request_id": d_id, "params": params, "blocks": [3, 1]}
        t = threading.Thread(target=lambda: dres.update(vd.command(cmd)))
        t.start()
        runner.append(t)

    leg = prefill_leg(kp.address, p_id, 2, 60, on_params=on_params)
    runner[0].join(120)
    assert leg.outcome == "ok", (leg.reason, leg.detail, dres, _state_of(vp, vd, vd64, kp))
    assert dres["ok"] is True and dres["sha256"] == leg.sha256, (dres, leg)
    for peer in (vp, vd, vd64):
        peer.assert_alive("after the fleet check and the push")


def _state_of(vp: VllmPeer, vd: VllmPeer, vd64: VllmPeer, kp: Served) -> str:
    """After a failed check: each endpoint's state and a fresh TCP look at it, so that a rare
    failure says whether the peers or the check were at fault."""
    lines = ["", "-- after the failed check:"]
    for peer in (vp, vd, vd64):
        seen = tcp_contact(peer.address, 3.0)
        lines.append(f"{peer.address}: {peer.why_not_alive() or 'alive'}; look: {seen}")
    seen = tcp_contact(kp.address, 3.0)
    lines.append(f"{kp.address} (kvpush): exit {kp.proc.poll()}; look: {seen}")
    return "\n".join(lines)
