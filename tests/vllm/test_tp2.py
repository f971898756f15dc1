"""vLLM's own connector at TP 2 (a P: two worker processes in a gloo TP group, see ``peer.py``)
against kvpush.

* vLLM's listener serves both ranks' metadata: ``kvpush probe --ranks 0,1 --peer-tp 2`` reads
  rank 1 (its own agent, its own memory, the same engine id), and both ranks stay alive.
* vLLM P (TP 2) -> kvpush D (TP 1), through ``kvpush drive --decode``: D registers with both
  P ranks, each rank WRITEs its heads into D's page and sends its completion, and D holds the
  pattern over all heads -- the digest a TP-1 P of that seed reports.

The D's geometry is the model's (``model_page_args``), not ``--like``: ``--like`` copies P's
per-rank page, and a TP-1 D of a TP-2 P holds the whole model's page (``tp x`` P's
``block_lens``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import VllmPeer, model_page_args, pattern_sha256

from tests.conftest import Served, ServeFactory, run_cli
from tests.support.procs import wait_ready

TP = 2
# P's lease: the leg's CLI starts only once P has finished, and nothing here tests the lease
# ending: long enough for a CLI's start on a loaded host (8 s was not, beside a CPU-bound process:
# ~4.5 s to start, ~2.3 s more to reach D).
LEASE_S = 30

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]


@pytest.fixture(scope="module")
def tp2(vllm_py: str, vllm_tmp: Path) -> Iterator[tuple[VllmPeer, Served]]:
    serve = ServeFactory(vllm_tmp)
    p = VllmPeer.start("P", vllm_tmp / "vllm-P-tp2", python=vllm_py, tp_size=TP, lease=LEASE_S)
    try:
        d = serve.start(
            "decode",
            *model_page_args(p.info),
            *("--heartbeat", "1", "--lease", str(LEASE_S)),
            wait=False,
        )
        wait_ready(d, 120)
        yield p, d
    finally:
        serve.close()
        p.stop()


def test_listener_serves_both_ranks(tp2: tuple[VllmPeer, Served]) -> None:
    p, _ = tp2
    r = run_cli("probe", p.address, "--ranks", "0,1", "--peer-tp", str(TP), "--json")
    if r.returncode != 0:  # (seen once: a listener silent for 3 s; say what held the port)
        raise p.error(
            f"probe exited {r.returncode}: {r.stdout}{r.stderr}\n"
            f"alive: {p.why_not_alive() or 'yes'}\nlistening: {p.listen_state()}"
        )
    md = json.loads(r.stdout)["metadata"]
    assert md["engine_id"] == p.engine_id
    assert md["block_lens"] == p.info["block_lens"]  # one head of two per rank
    assert md["kv_caches_base_addr"] != [hex(a) for a in p.info["kv_caches_base_addr"]]
    p.settle()
    p.assert_alive("probe of rank 1")


def test_vllm_p_tp2_to_kvpush_d(tp2: tuple[VllmPeer, Served], tmp_path: Path) -> None:
    p, d = tp2
    blocks = [2, 5, 7]
    p_id = "cmpl-tp2-0123456789ab-0000aaaa"
    marks = [p.wire_mark(rank=r) for r in range(TP)]
    cid = p.prefill(p_id, blocks)
    params = p.result(cid, suffix=".params")["params"]
    assert params["tp_size"] == TP
    f = tmp_path / "params.json"
    f.write_text(json.dumps(params))
    r = run_cli("leg", "decode", "--decode", d.address, "--kv-transfer-params", str(f), "--json")
    out = json.loads(r.stdout) if r.stdout else {}
    pres = p.result(cid, timeout=LEASE_S + 60)
    p.assert_alive("vLLM P (TP 2) -> kvpush D")
    assert r.returncode == 0 and out["outcome"] == "ok", (out, r.stderr)
    assert pres["lease_expired"] is False, pres
    assert out["sha256"] == pres["sha256"] == pattern_sha256(p.info, pres["seed"], blocks)
    assert out["nbytes"] == len(blocks) * TP * sum(p.info["block_lens"])
    for rank, mark in enumerate(marks):
        kinds = [rec["kind"] for rec in p.wire(mark, rank=rank)]
        assert "push_write" in kinds or rank > 0, (rank, kinds)  # the lead records its WRITE
        regs = [
            rec
            for rec in p.wire(mark, rank=rank)
            if rec["kind"] == "recv_notif" and rec["msg"]["type"] == "PUSH_REG"
        ]
        assert regs, f"rank {rank} got no PUSH_REG: {kinds}"
