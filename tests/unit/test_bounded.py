"""Bounded work per message, unit level (issue 17): the deadline heap, the shared timer thread,
expiry that touches only what is due in P's push table and D's request table, the wire's range
checks and the log escaping. Pure modules and one real timer thread; no sockets."""

from __future__ import annotations

import functools
import gc
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest

from kvpush.decode.requests import Delay, DRequest, PRanks, RequestTable, Waiting, WaitPhase
from kvpush.errors import BadValueError, ProtocolError
from kvpush.logsafe import OneLineFilter, shown
from kvpush.prefill.table import CancelledEarly, Finished, PushTable, Registration, reg_key
from kvpush.runtime.heap import YOUNG_THRESHOLD
from kvpush.runtime.timers import TRIM_SLACK, DueHeap, Timers
from kvpush.wire import protocol

# ------------------------------------------------------------------ DueHeap


def test_due_heap_yields_only_what_is_due_in_time_order() -> None:
    h: DueHeap[str] = DueHeap()
    for due, item in ((3.0, "c"), (1.0, "a"), (2.0, "b"), (9.0, "z")):
        h.push(due, item)
    assert list(h.pop_due(2.5)) == ["a", "b"]
    assert h.next_due() == 3.0 and len(h) == 2
    h.compact(lambda it: it != "z")
    assert list(h.pop_due(100.0)) == ["c"]
    assert h.next_due() == math.inf


def test_due_heap_trim_compacts_only_when_stale_entries_outnumber_live_ones() -> None:
    h: DueHeap[int] = DueHeap()
    live = set(range(10))
    for i in range(2 * 10 + TRIM_SLACK):
        h.push(float(i), i)
        h.trim(len(live), live.__contains__)
    assert len(h) == 2 * 10 + TRIM_SLACK  # at twice the live ones and the slack: kept as is
    h.push(1e9, -1)
    h.trim(len(live), live.__contains__)
    assert len(h) == 10 and list(h.pop_due(1e9)) == list(range(10))  # time order kept


# ------------------------------------------------------------------ Timers


def test_timers_fire_on_one_thread_and_cap_what_waits() -> None:
    t = Timers("test-timers", cap=3)
    fired: list[int] = []
    done = threading.Event()
    try:
        before = threading.active_count()
        a = t.add(0.05, lambda: fired.append(1))
        b = t.add(0.05, lambda: fired.append(2))

        def third() -> None:
            fired.append(3)
            done.set()

        c = t.add(0.10, third)
        assert a is not None and b is not None and c is not None
        assert t.add(0.01, lambda: fired.append(4)) is None  # at the cap: refused
        assert threading.active_count() <= before + 1  # one thread for all of them
        b.cancel()
        assert done.wait(5)
        assert fired == [1, 3] and len(t) == 0
        assert t.add(0.0, lambda: fired.append(5)) is not None  # room again
        time.sleep(0.2)
        assert fired == [1, 3, 5]
    finally:
        t.close()


def test_a_raising_callback_does_not_stop_the_timer_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = Timers("test-timers", cap=10)
    ok = threading.Event()

    def boom() -> None:
        raise OverflowError("timestamp out of range")

    try:
        t.add(0.0, boom)
        t.add(0.05, ok.set)
        assert ok.wait(5)
    finally:
        t.close()
    assert "a callback failed" in caplog.text


def test_cancelled_timers_are_compacted_away() -> None:
    t = Timers("test-timers", cap=10_000)
    try:
        timers = [t.add(3600.0, lambda: None) for _ in range(5000)]
        for x in timers:
            assert x is not None
            x.cancel()
        assert len(t) == 0
        assert len(t._heap) < 2100  # compacted as cancelled entries piled up
    finally:
        t.close()


# ------------------------------------------------------------------ P's push table


def _reg(key: str, t: float) -> Registration:
    r = protocol.PushReg(
        request_id=f"req-{key}",
        transfer_id=key,
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=1,
        local_block_ids=[[0, 1]],
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=2,
    )
    return Registration(reg_key(r), r, "d-agent", t)


def test_push_table_expiry_pops_each_entry_only_once_it_is_due() -> None:
    m = PushTable(lease_s=30.0, reg_ttl_s=60.0)
    for i in range(20_000):
        m.cancel_early(f"declined-{i}", now=0.0, reason="no_free_blocks")
    m.add_finished(Finished("f", "f", "f", np.arange(2, dtype=np.int64), 0.0), now=0.0)
    m.add_registration(_reg("r", 0.0))
    # A tick before anything is due pops nothing (the heap's head is not due) ...
    assert m.expire(now=1.0) == ([], [])
    assert len(m) == 20_002 and len(m._due) == 20_002
    # ... a renewed lease goes back in at its new time ...
    assert m.renew(["f"], now=25.0) == 1
    fins, regs = m.expire(now=30.5)
    assert fins == [] and regs == [] and m.get("f") is not None
    fins, regs = m.expire(now=46.0)
    assert [f.key for f in fins] == ["f"]
    # ... and the declined ids and the registration go once past their TTL.
    fins, regs = m.expire(now=60.5)
    assert [r.key for r in regs] == ["r"] and m.count(CancelledEarly) == 0 and len(m) == 0


def test_a_matched_push_is_freed_with_its_caller_not_held_by_its_lease_entry() -> None:
    """P's table holds its expiry entries weakly: finished blocks waiting for their PUSH_REG,
    once matched and written, are freed as soon as the writer lets go (the ids, the
    registrations), not kept until their lease entry comes up or is compacted away."""
    m = PushTable(lease_s=30.0, reg_ttl_s=60.0)
    gc.disable()
    try:
        ids = np.arange(2, dtype=np.int64)
        held = weakref.ref(ids)
        m.add_finished(Finished("f", "f", "f", ids, 0.0), now=0.0)
        del ids
        push = m.add_registration(_reg("f", 1.0))
        assert push is not None and held() is not None
        del push
        assert held() is None
        assert m.expire(now=100.0) == ([], []) and len(m) == 0
    finally:
        gc.enable()


def test_push_table_heap_stays_bounded_when_states_move_on() -> None:
    m = PushTable(lease_s=30.0, reg_ttl_s=60.0)
    for i in range(50_000):
        m.add_registration(_reg(f"t{i}", 0.0))
        m.pop(f"t{i}")  # matched or cancelled at once: its heap entry is stale
    assert len(m) == 0 and len(m._due) <= TRIM_SLACK + 1


# ------------------------------------------------------------------ D's request table


def _dreq(rid: str, deadline: float, alloc_at: float | None = None) -> Waiting:
    req = DRequest(
        request_id=rid,
        transfer_id=rid,
        p_addr=("127.0.0.1", 1),
        future=Future(),
        t_start=0.0,
        deadline=deadline,
        nbytes=0,
    )
    delay = None if alloc_at is None else Delay(2, alloc_at)
    return Waiting(req, PRanks(req.p_addr), np.empty(0, dtype=np.int64), delay)


def test_request_table_deadlines_and_allocations_by_heap() -> None:
    t = RequestTable()
    early, late = _dreq("early", 5.0), _dreq("late", 50.0)
    held = _dreq("held", 700.0, alloc_at=600.0)
    for r in (early, late, held):
        t.add(r)
    assert t.n_delayed == 1
    assert t.expired(1.0) == [] and t.due_for_blocks(1.0) == []
    assert t.expired(6.0) == [early]
    t.finish(early)
    assert t.expired(6.0) == []  # returned once
    # Due but still connecting to P: comes up again shortly, not lost.
    assert t.due_for_blocks(601.0) == []
    t.move(held, WaitPhase.WAITING_BLOCKS)
    assert t.due_for_blocks(601.1) == [(held, Delay(2, 600.0))]
    t.allocated(held, np.arange(2))
    assert t.n_delayed == 0 and held.delay is None
    assert t.busy_among([("127.0.0.1", 1, 0), ("127.0.0.1", 9, 0)]) == {("127.0.0.1", 1, 0)}
    assert t.busy_among([]) == set()


def test_request_table_keeps_no_ended_request_alive_until_its_deadline() -> None:
    """An answered request leaves nothing behind for long: its deadline entries are trimmed
    once they outnumber the live ones. (They held each request and its future for the whole
    deadline, 60 s: ~1M objects on a D answering 2,000 requests a second, and every full
    garbage collection walked them, stalling the process ~1 s.)"""
    t = RequestTable()
    futures: list[weakref.ref[Future[protocol.DecodeRep]]] = []
    for i in range(20_000):
        w = _dreq(f"r{i}", 60.0, alloc_at=30.0 if i % 2 else None)
        futures.append(weakref.ref(w.req.future))
        t.add(w)
        if w.delay is not None:
            t.move(w, WaitPhase.WAITING_BLOCKS)
            t.allocated(w, np.arange(1))
        if i % 3:
            t.finish(w)
        else:
            t.release_abandoned(t.abandon(w, {0}, quarantine_until=90.0))
        del w
    assert t.n_waiting == 0 and t.n_abandoned == 0 and t.n_delayed == 0
    heaps = (t._deadlines, t._allocs, t._quarantines, t._reports)
    assert all(len(h) <= TRIM_SLACK + 1 for h in heaps), [len(h) for h in heaps]
    assert sum(1 for f in futures if f() is not None) <= 4 * (TRIM_SLACK + 1)
    # A request still waiting stays, and comes up at its deadline.
    keep = _dreq("keep", 60.0)
    t.add(keep)
    for i in range(5_000):
        w = _dreq(f"s{i}", 60.0)
        t.add(w)
        t.finish(w)
    assert t.expired(61.0) == [keep]


def test_an_ended_request_is_freed_when_it_ends_not_when_its_deadline_entry_goes() -> None:
    """The table's deadline and allocation heaps hold requests weakly: once a request ended
    and its caller let go, its objects are freed at once by reference counting (hot in the
    cache), not later in a burst when its heap entry is compacted away or comes up. Its
    entry stays until then and is skipped."""
    t = RequestTable()
    gc.disable()  # (nothing here may depend on a collection)
    try:
        w = _dreq("gone", 60.0, alloc_at=30.0)
        fut = weakref.ref(w.req.future)
        t.add(w)
        t.finish(w)
        del w
        assert fut() is None
        assert t.expired(61.0) == [] and t.due_for_blocks(61.0) == []
    finally:
        gc.enable()


def test_a_steady_load_of_requests_starts_no_young_collection() -> None:
    """64 requests in flight, 30,000 answered: what the deadline heap keeps of the ended ones
    stays far below the young generation's threshold, so a steady load makes no young
    collection -- each one walks every young object still held and stops the process's
    threads meanwhile. (With 1,024 stale entries allowed, the ~1,100 ended requests a busy D
    kept, a future and two callbacks each, set one off every ~1,200 requests: 6-8 us of D's
    CPU a push in ``bench rate``, pauses of 7-17 ms.)"""
    t = RequestTable()
    live: list[Waiting] = []
    started: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 0:
            started.append(1)

    def request(i: int) -> Waiting:
        w = _dreq(f"r{i}", 60.0)
        for _ in range(2):  # (D's rank group adds one, its caller another)
            w.req.future.add_done_callback(functools.partial(on_done, i))
        return w

    def on_done(i: int, f: Future[protocol.DecodeRep]) -> None:
        assert f.done() and i >= 0

    for i in range(64):
        live.append(request(i))
        t.add(live[-1])
    gc.collect()
    old = gc.get_threshold()
    gc.callbacks.append(on_gc)
    gc.set_threshold(YOUNG_THRESHOLD, old[1], old[2])
    try:
        for i in range(64, 30_064):
            ended = live.pop(0)
            t.finish(ended)
            ended.req.future.set_result(protocol.DecodeRep(transfer_id="x", outcome="ok"))
            del ended
            live.append(request(i))
            t.add(live[-1])
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(on_gc)
    assert started == [], f"{len(started)} young collections under a steady load"


def test_request_table_quarantine_limit_by_heap() -> None:
    t = RequestTable()
    r = _dreq("q", 10.0)
    t.add(r)
    ab = t.abandon(r, {0}, quarantine_until=20.0)
    assert t.quarantine_over(19.0) == [] and t.quarantine_over(21.0) == [ab]


# ------------------------------------------------------------------ range checks at decode


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0, 1e300, 3601.0])
@pytest.mark.parametrize(
    "make",
    [
        lambda v: protocol.PushWaitReq(transfer_id="t", timeout_s=v),
        lambda v: protocol.DecodeReq(
            transfer_id="t", prefill_host="h", prefill_port=1, num_blocks=1, alloc_delay_s=v
        ),
    ],
    ids=["push_wait.timeout_s", "decode.alloc_delay_s"],
)
def test_absurd_seconds_are_a_bad_value(
    make: Callable[[float], protocol.SideRequest], value: float
) -> None:
    with pytest.raises(BadValueError, match=r"Expected `float`"):
        protocol.decode_request_body(protocol.encode(make(value)))


def test_deadline_bounds_and_wrong_types_stay_malformed() -> None:
    ok = protocol.DecodeReq(
        transfer_id="t", prefill_host="h", prefill_port=1, num_blocks=1, deadline_s=86400.0
    )
    assert protocol.decode_request_body(protocol.encode(ok)) == ok
    with pytest.raises(BadValueError):
        protocol.decode_request_body(
            protocol.encode(
                protocol.DecodeReq(
                    transfer_id="t", prefill_host="h", prefill_port=1, num_blocks=1, deadline_s=1e9
                )
            )
        )
    with pytest.raises(ProtocolError) as ei:
        protocol.decode_request_body(protocol.encode({"type": "push_wait", "transfer_id": 7}))
    assert not isinstance(ei.value, BadValueError)


# ------------------------------------------------------------------ logs that cannot be forged


def test_shown_escapes_control_characters_only() -> None:
    assert shown("plain id-1 é ü") == "plain id-1 é ü"
    assert shown("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert shown("\x1b[31mred\x1b[0m\x00\x7f\x85") == "\\x1b[31mred\\x1b[0m\\x00\\x7f\\x85"
    assert shown("x\u2028y\u2029") == "x\\u2028y\\u2029"


def test_one_line_filter_keeps_a_record_on_one_line() -> None:
    rec = logging.LogRecord(
        "kvpush.x", logging.WARNING, __file__, 1, "lease of %s lapsed (%d)", ("id\nFORGED", 3), None
    )
    assert OneLineFilter().filter(rec)
    assert rec.getMessage() == "lease of id\\nFORGED lapsed (3)"
    clean = logging.LogRecord("kvpush.x", logging.INFO, __file__, 1, "ok %s", ("id",), None)
    assert OneLineFilter().filter(clean) and clean.args == ("id",)  # left as it was
