"""Handshake faults (issue 5, tests 5 and 9): peers that never answer, and incompatible peers.

A side channel that never answers (a bound ROUTER: a black hole) or a TCP listener that accepts
and never speaks must fail the handshake within the handshake deadline, with a typed error that
names the peer, while handshakes and pushes with healthy peers carry on. An incompatible peer is
refused with every differing field named with both sides' values, by D (D->P handshake) and by
P (P->D handshake, driven by a PUSH_REG from a third process).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from kvpush.wire import protocol
from tests.support.cluster import FAST_TIMEOUTS, SMALL_POOL, cluster_ctx
from tests.support.fault_legs import Result, run_leg
from tests.support.forger import Forger
from tests.support.invariants import check_results, fresh_batch, settle
from tests.support.side import failures, request, snapshot
from tests.support.silent_peers import BlackHole, SilentListener
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration

HANDSHAKE_S = FAST_TIMEOUTS["handshake_s"]


def _push_reg(tid: str, d_host: str, d_port: int, p_addr: str, blocks: list[int]) -> dict:
    p_host, p_port = p_addr.rsplit(":", 1)
    return {
        "type": "PushReg",
        "request_id": tid,
        "transfer_id": tid,
        "decode_engine_id": "d-forged",
        "decode_host": d_host,
        "decode_port": d_port,
        "local_block_ids": [blocks],
        "remote_engine_id": "p",
        "remote_host": p_host,
        "remote_port": int(p_port),
    }


@pytest.mark.slow
def test_black_hole_and_silent_side_channels(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c, BlackHole() as hole, SilentListener() as mute:
        p = c.start("prefill", "p")
        # D's side-channel and handshake deadlines are long enough that "healthy requests
        # finish while the hole's handshake is pending" is not a race on a loaded host.
        d = c.start("decode", "d", timeouts={"side_channel_s": 3.0, "handshake_s": 4.0})
        fresh_batch(p.address, [d.address], n=4)

        # D -> P: D's requests name a P that never answers. Meanwhile D serves the real P.
        stuck: list[Result] = []
        threads = [
            threading.Thread(
                target=lambda a=a, i=i: stuck.append(
                    run_leg(f"stuck-{i}", a, d.address, 4, send_p=False, d_timeout_s=10)
                )
            )
            for i, a in enumerate([hole.address, mute.address] * 2)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.1)  # D's handshakes with both are now pending
        fresh_batch(p.address, [d.address], n=12, prefix="during")
        t_during = time.monotonic() - t0
        for t in threads:
            t.join(20)
        assert len(stuck) == 4
        check_results(stuck)
        named: dict[str, BlackHole | SilentListener] = {
            "stuck-0": hole,
            "stuck-1": mute,
            "stuck-2": hole,
            "stuck-3": mute,
        }
        for r in stuck:
            peer = named[r.tid].address
            assert r.outcome == "failed" and r.reason == "prefill_unreachable", r
            assert peer in r.detail, r  # the error names the peer
            # Within D's handshake deadline (plus process and scheduling slack).
            assert r.latency_s < 4.0 + 1.5, r
        assert t_during < min(r.latency_s for r in stuck), "healthy pushes waited for the hole"
        assert mute.accepted >= 1

        # P -> D: a PUSH_REG (from a third process) names a "D" whose side channel is a black
        # hole; P's handshake fails by its deadline, naming the peer, and P keeps pushing to D.
        forger = Forger(tmp_path)
        try:
            forger.connect(p.address)
            targets: tuple[BlackHole | SilentListener, ...] = (hole, mute)
            for i, target in enumerate(targets):
                tid = f"to-nowhere-{i}"
                forger.send(p.address, _push_reg(tid, "127.0.0.1", target.port, p.address, [0]))
                wait_for(
                    lambda: snapshot(p.address)["gauges"]["regs_waiting_blocks"] == 1, 30, "reg"
                )
                rep = request(p.address, protocol.PrefillReq(transfer_id=tid, num_blocks=1))
                assert rep.outcome == "ok", rep
            fresh_batch(p.address, [d.address], n=12, prefix="p-during")

            def hole_rows() -> list[dict]:
                return [
                    r
                    for r in snapshot(p.address)["peers"]
                    if r["peer"] in (hole.address, mute.address)
                ]

            wait_for(
                lambda: [r["state"] for r in hole_rows()] == ["failed", "failed"],
                2 * HANDSHAKE_S + 3,
                "P's handshakes with the black hole and the silent listener to fail",
            )
            for row in hole_rows():
                assert row["peer"] in row["last_error"], row  # the error names the peer
                assert row["duration_s"] < HANDSHAKE_S + 0.5, row  # within the deadline
            assert failures(p.address).get("decode_unreachable", 0) >= 2  # typed: no answer
        finally:
            forger.close()
        for a in (p.address, d.address):
            settle(a, quarantine_clears=True)
        fresh_batch(p.address, [d.address], n=8, prefix="after")


VARIANTS: dict[str, tuple[dict[str, object], set[str]]] = {
    "block_bytes": ({"block_bytes": 32 * 1024}, {"block_bytes"}),
    "layers": ({"layers": 3}, {"layers", "regions"}),
    "dtype": ({"dtype": "float32"}, {"dtype"}),
    "all": (
        {"block_bytes": 32 * 1024, "layers": 1, "dtype": "float16"},
        {"block_bytes", "layers", "regions", "dtype"},
    ),
}


def _named(text: str) -> dict[str, tuple[str, str]]:
    """field -> (local, remote) as the error message states them."""
    return {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"(\w+): local=([^ ;]+) remote=([^ ;]+)", text)
    }


@pytest.mark.slow  # ~20 s: in `make test-slow` (CI), keeps `make test` under 10 minutes
def test_compat_mismatch_names_every_field_on_both_sides(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        ds = {
            name: c.start("decode", f"d-{name}", pool={**SMALL_POOL, **geom})
            for name, (geom, _) in VARIANTS.items()
        }
        p_geom = {"block_bytes": SMALL_POOL["block_bytes"], "layers": SMALL_POOL["layers"]}
        forger = Forger(tmp_path)
        try:
            forger.connect(p.address)
            for name, (geom, fields) in VARIANTS.items():
                d = ds[name]
                # D side: D's handshake with P refuses, naming each field (local = D's value).
                r = run_leg(f"mm-{name}", p.address, d.address, 2, send_p=False)
                assert r.outcome == "failed" and r.reason == "incompatible", r
                assert "incompatible" in r.detail and p.address in r.detail, r
                named = _named(r.detail)
                assert set(named) == fields, (named, r.detail)
                for f, (local, remote) in named.items():
                    if f in geom:
                        assert local.strip("'") == str(geom[f]), (f, local, r.detail)
                    if f in p_geom:
                        assert remote == str(p_geom[f]), (f, remote, r.detail)

                # P side: a PUSH_REG naming this D makes P handshake with it; P refuses too.
                tid = f"mmp-{name}"
                forger.send(p.address, _push_reg(tid, "127.0.0.1", d.port, p.address, [0, 1]))
                wait_for(
                    lambda: snapshot(p.address)["gauges"]["regs_waiting_blocks"] == 1, 30, "reg"
                )
                rep = request(p.address, protocol.PrefillReq(transfer_id=tid, num_blocks=2))
                assert rep.outcome == "ok", rep
                row = wait_for(
                    lambda d=d: next(
                        (
                            x
                            for x in snapshot(p.address)["peers"]
                            if x["peer"] == d.address and x["state"] == "failed"
                        ),
                        None,
                    ),
                    HANDSHAKE_S + 2,
                    f"P to refuse {name}",
                )
                print(name, "| D:", r.detail, "| P:", row["last_error"])
                p_named = _named(row["last_error"])
                assert set(p_named) == fields, row
                for f, (_local, remote) in p_named.items():
                    if f in geom:
                        assert remote.strip("'") == str(geom[f]), (f, row)
        finally:
            forger.close()
        assert failures(p.address).get("incompatible", 0) >= len(VARIANTS)
        # Incompatible peers leave nothing behind, and P keeps serving a compatible D.
        good = c.start("decode", "good")
        fresh_batch(p.address, [good.address], n=8)
        for a in (p.address, good.address, *(d.address for d in ds.values())):
            settle(a, quarantine_clears=True)
