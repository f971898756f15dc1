"""D's request table (``kvpush.decode.requests``), unit level: the typed states and the moves
between them (waiting by phase, delayed, abandoned, gone), the counts the table keeps, and the
reads the receiver's housekeeping makes of abandoned requests (held by a gone P rank,
heartbeat groups, long quarantines reported once, a time-limited quarantine). Pure."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from kvpush.config import HandshakeMode, Role
from kvpush.decode.requests import (
    Abandoned,
    Delay,
    DRequest,
    PRanks,
    RequestTable,
    Waiting,
    WaitPhase,
)
from kvpush.peers.handshakes import PeerConn
from tests.support.fakes import make_metadata, stub_pool

P_ADDR = ("127.0.0.1", 7000)


def _conn(rank: int, agent: str = "") -> PeerConn:
    md = make_metadata(Role.PREFILL, stub_pool(num_blocks=4), engine_id="p", incarnation="i")
    return PeerConn(
        key=(*P_ADDR, rank),
        metadata=md,
        agent_name=agent or f"p#{rank}",
        mode=HandshakeMode.NOTIF,
        remote_dlist=None,
        timings={},
        rtt_s=0.0,
        clock_offset_s=0.0,
    )


def _waiting(rid: str, sources: tuple[int, ...] = (0,), delay: Delay | None = None) -> Waiting:
    req = DRequest(
        request_id=rid,
        transfer_id=f"t-{rid}",
        p_addr=P_ADDR,
        future=Future(),
        t_start=0.0,
        deadline=100.0,
        nbytes=0,
    )
    ranks = PRanks(P_ADDR, p_tp=len(sources), sources=sources)
    ranks.conns = {s: _conn(s) for s in sources}
    return Waiting(req, ranks, np.arange(2, dtype=np.int64), delay)


def test_moves_keep_the_counts_per_phase() -> None:
    t = RequestTable()
    a, b, c = _waiting("a"), _waiting("b"), _waiting("c", delay=Delay(2, 5.0))
    for w in (a, b, c):
        t.add(w)
    assert (t.count(WaitPhase.NEW), t.n_waiting, t.n_delayed) == (3, 3, 1)
    t.move(a, WaitPhase.HANDSHAKING)
    t.move(b, WaitPhase.REGISTERED)
    t.move(c, WaitPhase.WAITING_BLOCKS)
    assert [t.count(p) for p in WaitPhase] == [0, 1, 1, 1, 0]
    t.finish(b)
    assert b.phase is WaitPhase.ENDED and t.waiting("b") is None
    assert t.count(WaitPhase.REGISTERED) == 0 and t.n_waiting == 2
    t.finish(c)  # a delayed request that ends is no longer delayed
    assert t.n_delayed == 0 and c.delay is None
    t.move(a, WaitPhase.REGISTERED)
    ab = t.abandon(a, {0})
    assert a.phase is WaitPhase.ENDED and t.waiting("a") is None and t.abandoned("a") is ab
    assert sum(t.count(p) for p in WaitPhase) == 0 and (t.n_waiting, t.n_abandoned) == (0, 1)
    assert t.in_use("a") and not t.in_use("b")
    with pytest.raises(ValueError, match="in use"):
        t.add(_waiting("a"))  # its blocks are still quarantined under that id
    t.release_abandoned(ab)
    assert t.n_abandoned == 0 and not t.in_use("a")


def test_an_abandoned_request_keeps_what_it_waits_on() -> None:
    t = RequestTable()
    w = _waiting("a", sources=(0, 1))
    t.add(w)
    w.registered = {0, 1}
    ab = t.abandon(w, {1}, quarantine_until=None)
    assert isinstance(ab, Abandoned)
    assert ab.req is w.req and ab.ranks is w.ranks and ab.outstanding == {1}
    assert ab.block_ids.tolist() == [0, 1] and ab.quarantine_until is None
    waiting, abandoned = t.of_peer((*P_ADDR, 1))
    assert waiting == [] and abandoned == [ab]
    assert t.busy_among([(*P_ADDR, 0), (*P_ADDR, 5)]) == {(*P_ADDR, 0)}


def test_heartbeats_go_to_registered_and_fence_waiting_ranks_only() -> None:
    t = RequestTable()
    new, reg, held = _waiting("new"), _waiting("reg", sources=(0,)), _waiting("held", (1,))
    for w in (new, reg, held):
        t.add(w)
    t.move(reg, WaitPhase.REGISTERED)
    t.move(held, WaitPhase.WAITING_BLOCKS)
    fenced = _waiting("fenced", sources=(2,))
    t.add(fenced)
    t.abandon(fenced, {2})
    leased = _waiting("leased", sources=(3,))
    t.add(leased)
    t.abandon(leased, {3}, quarantine_until=50.0)  # vLLM's wire: no empty heartbeat
    groups = {conn.agent_name: tids for conn, tids in t.heartbeat_groups()}
    assert groups == {"p#0": ["t-reg"], "p#1": ["t-held"], "p#2": []}


def test_held_by_gone_names_ranks_without_a_live_connection() -> None:
    t = RequestTable()
    w = _waiting("a", sources=(0, 1, 2))
    t.add(w)
    ab = t.abandon(w, {0, 1, 2})
    ab.ranks.conns[1].evicted = True
    del ab.ranks.conns[2]
    assert sorted(rank for _, rank in t.held_by_gone()) == [1, 2]
    leased = _waiting("b", sources=(4,))
    t.add(leased)
    del leased.ranks.conns[4]
    t.abandon(leased, {4}, quarantine_until=9.0)  # bounded by P's lease, not by P's conn
    assert all(r is ab for r, _ in t.held_by_gone())


def test_time_limited_quarantine_and_long_quarantine_reports_come_once() -> None:
    t = RequestTable(report_after_s=10.0)
    w, v = _waiting("a"), _waiting("b")
    t.add(w)
    t.add(v)
    ab = t.abandon(w, {0}, quarantine_until=1e12)
    gone = t.abandon(v, {0})
    assert t.quarantine_over(1e12 - 1) == [] and t.quarantine_over(1e12) == [ab]
    now = ab.t_abandoned
    assert t.long_quarantined(now + 9.0) == []
    t.release_abandoned(gone)  # released before its report is due: never reported
    assert t.long_quarantined(now + 10.5) == [ab]
    assert t.long_quarantined(now + 100.0) == []  # once


def test_deadlines_and_allocation_times_come_up_once() -> None:
    t = RequestTable()
    w = _waiting("a", delay=Delay(3, 5.0))
    t.add(w)
    assert t.due_for_blocks(5.0) == []  # still connecting: comes up again shortly
    t.move(w, WaitPhase.WAITING_BLOCKS)
    assert t.due_for_blocks(5.06) == [(w, Delay(3, 5.0))]
    assert t.due_for_blocks(6.0) == []
    t.allocated(w, np.arange(3))
    assert w.delay is None and t.n_delayed == 0 and w.block_ids.tolist() == [0, 1, 2]
    assert t.expired(99.0) == [] and t.expired(100.0) == [w] and t.expired(200.0) == []


def test_ending_a_request_the_table_does_not_hold_leaves_the_one_it_holds() -> None:
    """A second request under an id in use (refused when added) ends without touching the
    request that holds the id, or the counts."""
    t = RequestTable()
    held, dup = _waiting("a", delay=Delay(1, 5.0)), _waiting("a", delay=Delay(1, 5.0))
    t.add(held)
    with pytest.raises(ValueError, match="in use"):
        t.add(dup)
    t.finish(dup)
    assert dup.phase is WaitPhase.ENDED and t.waiting("a") is held
    assert (t.n_waiting, t.count(WaitPhase.NEW), t.n_delayed) == (1, 1, 1)
