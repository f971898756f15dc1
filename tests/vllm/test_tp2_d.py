"""kvpush P (TP 1) -> vLLM's own D at TP 2 (two worker processes in a gloo TP group, see
``peer.py``), the ratio D_tp = 2 x P_tp of VLLM_INTEROP.md 4.

vLLM's ``PUSH_REG`` does not name D's rank, and both D ranks send one. kvpush's P does what
vLLM's own P does: the first ``PUSH_REG`` of a request stands for both ranks (vLLM's D
allocates the same block ids on every rank), P does a full handshake of each rank (vLLM's
listener serves both ranks' metadata) and WRITEs each rank its half of every page -- rank r
the heads ``[r*h, (r+1)*h)`` -- with one completion ``"<D request id>:1"`` per rank; the other
rank's ``PUSH_REG`` is absorbed. vLLM's D finishes the request once both ranks report it, and
the bytes its two ranks hold together hash like the pages kvpush's P pushed.

P's geometry is the model's (``model_page_args``: ``--like`` would copy one D rank's page, and
a TP-1 P holds ``tp x`` D's ``block_lens``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import VllmPeer, model_page_args, request_ids

from kvpush.commands.leg.legs import prefill_leg
from tests.conftest import Served, ServeFactory
from tests.support.procs import wait_ready

TP = 2
LEASE_S = 8

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]


@pytest.fixture(scope="module")
def d_tp2(vllm_py: str, vllm_tmp: Path) -> Iterator[tuple[VllmPeer, Served]]:
    serve = ServeFactory(vllm_tmp)
    # Rank 1 slow (a loaded host made it so once): P may WRITE both ranks on rank 0's PUSH_REG,
    # so D's rank 1 must have cleared its blocks a step before either rank sends one.
    d = VllmPeer.start(
        "D",
        vllm_tmp / "vllm-D-tp2",
        python=vllm_py,
        tp_size=TP,
        lease=LEASE_S,
        extra=["--rank-work-delay", "0.5"],
    )
    try:
        p = serve.start(
            "prefill",
            *model_page_args(d.info),
            *("--lease", str(LEASE_S)),
            wait=False,
        )
        wait_ready(p, 120)
        yield d, p
    finally:
        serve.close()
        d.stop()


def test_kvpush_p_tp1_to_vllm_d_tp2(d_tp2: tuple[VllmPeer, Served]) -> None:
    d, p = d_tp2
    p_id, d_id = request_ids("k2v-tp2")
    d_blocks = [9, 2, 5]
    marks = [d.wire_mark(rank=r) for r in range(TP)]
    dres: dict[str, Any] = {}
    runner: list[threading.Thread] = []

    def hand_to_d(params: dict[str, Any]) -> None:
        dres.update(
            d.command({"op": "decode", "request_id": d_id, "params": params, "blocks": d_blocks})
        )

    def on_params(params: dict[str, Any]) -> None:
        t = threading.Thread(target=hand_to_d, args=(params,))
        t.start()
        runner.append(t)

    rep = prefill_leg(p.address, p_id, len(d_blocks), 90, on_params=on_params)
    runner[0].join(150)
    d.assert_alive("kvpush P (TP 1) -> vLLM D (TP 2)")
    assert rep.outcome == "ok", (rep.reason, rep.detail, dres)
    assert dres["ok"] is True and dres["failed"] is False, dres
    assert dres["sha256"] == rep.sha256, (dres, rep)
    assert rep.nbytes == len(d_blocks) * TP * sum(d.info["block_lens"])
    for rank, mark in enumerate(marks):
        wire = d.wire(mark, rank=rank)
        sent = [r for r in wire if r["kind"] == "send_notif"]
        assert any(r["msg"]["type"] == "PUSH_REG" for r in sent), (rank, wire)
        recv = [r["msg"]["raw"] for r in wire if r["kind"] == "recv_notif"]
        assert recv == [f"{d_id}:1"], (rank, recv)  # each rank: one completion, vLLM's form
