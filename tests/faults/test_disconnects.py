"""Disconnects heal (issue 16, item 3): real P and D processes, real NIXL on 127.0.0.1.

A transport error on an established peer moves it connected -> degraded -> evicted (at once when
NIXL says the remote agent is gone, else after ``evict_after_errors`` in a row), counted by NIXL
status in telemetry; the next request handshakes afresh. WRITEs that only time out (a frozen D)
degrade the peer without evicting it, and it heals in place once it thaws. Handshakes to one
peer are single-flight with a real agent too, and agents are created one at a time in a process.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

from kvpush.config import AgentConfig, HandshakeMode, PoolConfig, Role, Timeouts
from kvpush.peers.handshakes import HandshakeManager
from kvpush.telemetry.store import Telemetry
from kvpush.transport import nixl
from kvpush.transport.nixl import NixlAgent
from kvpush.wire.auth import Authenticator
from tests.support.cluster import cluster_ctx
from tests.support.fakes import make_metadata
from tests.support.fault_legs import run_leg
from tests.support.invariants import check_results, fresh_batch, settle
from tests.support.side import counters, snapshot
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration


def test_agent_lost_under_an_established_d_is_evicted_and_rehandshaken(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        # After its 8th push, P's NIXL forgets D's agent while P still holds the connection.
        p = c.start("prefill", "p", drop_agents_after=8)
        d = c.start("decode", "d")
        fresh_batch(p.address, [d.address], n=8, prefix="before")
        wait_for(lambda: "fault injection" in c.procs["p"].log_text(), 10, "the agent dropped")
        before = counters(p.address)
        assert before.get("handshakes_ok", 0) == 1, before

        # The next push meets NIXL_ERR_NOT_FOUND: the request fails with a named reason, the
        # peer is degraded and, its agent being gone, evicted at once.
        r = run_leg(f"cut-{uuid.uuid4().hex[:6]}", p.address, d.address, 4)
        assert r.outcome == "failed" and r.reason == "write_post_failed", r
        after = counters(p.address)
        # (the WRITE's post, and the failure notification to D: D hears over its side channel)
        assert after.get("transport_errors_nixl_err_not_found", 0) >= 1, after
        assert after.get("peers_degraded", 0) == 1, after
        assert after.get("peers_evicted_transport", 0) == 1, after
        assert after.get("stale_agents_removed", 0) == 1, after

        # The next request handshakes afresh and succeeds; nothing went to the dropped agent.
        fresh_batch(p.address, [d.address], n=8, prefix="healed")
        snap = snapshot(p.address)
        assert snap["counters"]["handshakes_ok"] == 2, snap["counters"]
        assert snap["gauges"]["stale_agent_uses"] == 0
        assert snap["gauges"]["remote_agents"] == 1
        (row,) = [r for r in snap["peers"] if r["peer"] == d.address]
        assert row["state"] == "connected", row
        for a in (p.address, d.address):
            settle(a, quarantine_clears=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_d_frozen_past_the_write_timeout_is_degraded_and_heals_in_place(tmp_path: Path) -> None:
    """WRITEs into a SIGSTOPped D that do not complete by the write deadline are transport
    errors (``write_timeout``): the D is degraded but not evicted, even past the limit (its
    bytes may still land: only a fence on the same connection proves they did); once it thaws
    the fences land, nothing stays quarantined and the next requests succeed through the same
    agent (no new handshake)."""
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", evict_after_errors=2)
        d = c.start("decode", "d", timeouts={"request_deadline_s": 20.0})
        fresh_batch(p.address, [d.address], n=4)
        done: list = []

        def load() -> None:
            items = [f"frozen-{i}" for i in range(6)]
            ts = [
                threading.Thread(
                    target=lambda t=t: done.append(
                        run_leg(t, p.address, d.address, 32, p_delay_s=4.0, d_timeout_s=30)
                    )
                )
                for t in items
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)

        t = threading.Thread(target=load)
        t.start()
        wait_for(lambda: snapshot(p.address)["gauges"]["regs_waiting_blocks"] >= 6, 20, "regs")
        c.freeze("d")
        try:
            wait_for(
                lambda: (
                    counters(p.address).get("pushes_ok", 0) >= 4 + 6
                    or counters(p.address).get("transport_errors_write_timeout", 0) >= 2
                ),
                20,
                "WRITEs into frozen D to time out (or complete)",
            )
        finally:
            time.sleep(1.0)
            c.thaw("d")
        t.join(60)
        cs = counters(p.address)
        print(
            "P counters after the freeze:",
            {k: v for k, v in cs.items() if "transport" in k or "peers_" in k or "handshakes" in k},
        )
        check_results(done)
        if cs.get("transport_errors_write_timeout", 0) < 2:
            pytest.skip("UCX completed every WRITE into the stopped process (no timeout here)")
        assert cs.get("peers_degraded", 0) >= 1, cs
        assert cs.get("peers_evicted_transport", 0) == 0, cs
        fresh_batch(p.address, [d.address], n=8, prefix="thawed")
        assert counters(p.address)["handshakes_ok"] == cs["handshakes_ok"]
        for a in (p.address, d.address):
            settle(a, timeout_s=20, quarantine_clears=True)


# ------------------------------------------------------------------ single flight, real NIXL


class _CountingAgent(NixlAgent):
    """A real NIXL agent that counts ``add_remote`` calls and how many overlap."""

    def __init__(self, name: str) -> None:
        super().__init__(name, AgentConfig())
        self.adds = 0
        self.overlap = 0
        self._active = 0
        self._count_lock = threading.Lock()

    def add_remote(self, metadata: bytes) -> str:
        with self._count_lock:
            self.adds += 1
            self._active += 1
            self.overlap = max(self.overlap, self._active)
        try:
            time.sleep(0.05)  # widen the window a second add would race into
            return super().add_remote(metadata)
        finally:
            with self._count_lock:
                self._active -= 1


def test_handshakes_to_one_peer_are_single_flight_with_a_real_agent(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        agent = _CountingAgent(f"d-sf#{uuid.uuid4().hex[:8]}")
        pool = PoolConfig(num_blocks=256, layers=2, block_bytes=16 * 1024)
        md = make_metadata(Role.DECODE, pool, engine_id="d-sf", incarnation=uuid.uuid4().hex)
        tm = Telemetry(Role.DECODE, "d-sf")
        hs = HandshakeManager(agent, md, Authenticator(None), Timeouts(), tm)
        host, port = p.address.rsplit(":", 1)
        key = (host, int(port), 0)
        go = threading.Barrier(16)
        futs: list = []
        lock = threading.Lock()

        def one() -> None:
            go.wait()
            f = hs.ensure(key, HandshakeMode.NOTIF)
            with lock:
                futs.append(f)

        ts = [threading.Thread(target=one) for _ in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        conns = {id(f.result(30)) for f in futs if f is not None}
        assert len(conns) == 1  # every caller got the one connection
        assert agent.adds == 1 and agent.overlap == 1, (agent.adds, agent.overlap)
        assert tm.snapshot().counters["handshakes_started"] == 1
        assert counters(p.address).get("handshakes_served", 0) == 1
        for conn in hs.close():
            hs.release_conn(conn)
        agent.close()


def test_agents_of_one_process_are_created_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks create their agents on their own threads: NIXL #1668 (UCX 1.20.0 hangs when two
    agents initialise at once) is avoided by the adapter's process-wide lock."""
    api, _ = nixl._import_nixl()
    real = api.nixl_agent
    active = {"now": 0, "max": 0}
    lock = threading.Lock()

    def counting(*a: object, **kw: object) -> object:
        with lock:
            active["now"] += 1
            active["max"] = max(active["max"], active["now"])
        try:
            time.sleep(0.05)
            return real(*a, **kw)
        finally:
            with lock:
                active["now"] -= 1

    monkeypatch.setattr(api, "nixl_agent", counting)
    agents: list[NixlAgent] = []
    go = threading.Barrier(4)

    def make(i: int) -> None:
        go.wait()
        agents.append(NixlAgent(f"lock-{i}-{uuid.uuid4().hex[:6]}", AgentConfig()))

    ts = [threading.Thread(target=make, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert len(agents) == 4
    assert active["max"] == 1, active
    for a in agents:
        a.close()
