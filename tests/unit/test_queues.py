"""Bounded, closable, typed inboxes and the one drain helper."""

from __future__ import annotations

import threading

import pytest

from kvpush.errors import ShuttingDownError
from kvpush.runtime.inbox import Inbox, InboxFullError, drain_into


def test_put_wakes_and_drain_is_fifo() -> None:
    wake = threading.Event()
    q: Inbox[int] = Inbox("t", 10, wake)
    assert q.wake is wake
    q.put(1)
    assert wake.is_set()
    q.put(2)
    q.put(3)
    assert len(q) == 3
    assert list(q.drain()) == [1, 2, 3]
    assert len(q) == 0 and list(q.drain()) == []


def test_own_event_when_none_given() -> None:
    q: Inbox[int] = Inbox("t", 1)
    assert not q.wake.is_set()
    q.put(1)
    assert q.wake.is_set()


def test_shared_wake_event() -> None:
    wake = threading.Event()
    a: Inbox[int] = Inbox("a", 2, wake)
    b: Inbox[str] = Inbox("b", 2, wake)
    b.put("x")
    assert wake.is_set()
    wake.clear()
    a.put(1)
    assert wake.is_set()


def test_drain_limit() -> None:
    q: Inbox[int] = Inbox("t", 10)
    for i in range(5):
        q.put(i)
    assert list(q.drain(limit=2)) == [0, 1]
    assert list(q.drain(limit=0)) == []
    assert list(q.drain()) == [2, 3, 4]


def test_full_raises_and_keeps_items() -> None:
    q: Inbox[int] = Inbox("deferred", 2)
    q.put(1)
    q.put(2)
    with pytest.raises(InboxFullError) as ei:
        q.put(3)
    assert str(ei.value) == "deferred inbox is full (2)"
    assert ei.value.hint == "the endpoint is overloaded"
    assert list(q.drain()) == [1, 2]
    q.put(3)  # room again


def test_close_returns_rest_and_refuses_puts() -> None:
    q: Inbox[int] = Inbox("finished", 5)
    q.put(1)
    q.put(2)
    q.wake.clear()
    assert q.close() == [1, 2]
    assert q.closed and len(q) == 0
    assert q.wake.is_set()  # the owner wakes up to see it
    with pytest.raises(ShuttingDownError, match=r"^finished inbox is closed$"):
        q.put(3)
    assert q.close() == []


def test_drain_into_counts_and_propagates() -> None:
    q: Inbox[int] = Inbox("t", 10)
    for i in range(4):
        q.put(i)
    seen: list[int] = []
    assert drain_into(q, seen.append, limit=3) == 3
    assert seen == [0, 1, 2]

    def boom(x: int) -> None:
        raise ValueError(x)

    with pytest.raises(ValueError):
        drain_into(q, boom)
    assert len(q) == 0  # the item that raised was consumed: handlers guard themselves


def test_concurrent_producers_one_consumer() -> None:
    q: Inbox[tuple[int, int]] = Inbox("t", 1 << 20)
    n, per = 8, 2000
    start = threading.Barrier(n)

    def produce(p: int) -> None:
        start.wait()
        for i in range(per):
            q.put((p, i))

    ts = [threading.Thread(target=produce, args=(p,)) for p in range(n)]
    for t in ts:
        t.start()
    got: list[tuple[int, int]] = []
    while any(t.is_alive() for t in ts) or len(q):
        got.extend(q.drain())
    for t in ts:
        t.join()
    got.extend(q.drain())
    assert len(got) == n * per
    for p in range(n):  # per-producer order is kept
        assert [i for pp, i in got if pp == p] == list(range(per))


def test_no_put_is_missed_by_an_owner_that_clears_then_drains() -> None:
    """A put skips ``set`` when the event is set already; an owner that sleeps on the event,
    clears it and then drains (``IdleWaiter``, then the next pass) still sees every item, at
    once: four producers, 20,000 puts, no wait of the owner's runs out."""
    wake = threading.Event()
    boxes: list[Inbox[int]] = [Inbox(f"b{k}", 1 << 20, wake) for k in range(2)]
    per, producers = 5_000, 4

    def produce(k: int) -> None:
        for i in range(per):
            boxes[(k + i) % 2].put(i)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    for t in threads:
        t.start()
    got = 0
    while got < per * producers:
        assert wake.wait(5.0), f"the owner slept through a put ({got} of {per * producers})"
        wake.clear()
        got += sum(len(list(b.drain())) for b in boxes)
    for t in threads:
        t.join()
    assert got == per * producers
