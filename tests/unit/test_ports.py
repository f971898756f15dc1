"""Ports handed to processes that bind them later come from below the kernel's ephemeral range,
where no outgoing connection can take them in the meantime (``kvpush.commands.common.ports``)."""

from __future__ import annotations

import random
import socket
from collections import deque

import pytest

from kvpush.commands.common import ports


def _listen(port: int) -> None:
    """Listen on ``port`` as every process given one does (ZMQ, etcd, the metrics server):
    with SO_REUSEADDR, so a port whose last connection is in TIME_WAIT is free to it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert 1024 <= port < low
        _listen(port)


def test_a_port_whose_last_connection_is_in_time_wait_is_free_to_a_listener() -> None:
    """The port of an earlier listener (SO_REUSEADDR, as they all set it) whose accepted
    connection waits in TIME_WAIT is handed out, and a listener takes it. A bare bind, without
    SO_REUSEADDR, fails there: this file's first test once bound that way, and failed now and then
    in the suite, after other tests' endpoints had used the port it was handed."""
    with socket.socket() as lsn:
        lsn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsn.bind(("127.0.0.1", ports.free_port()))
        lsn.listen()
        port = lsn.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = lsn.accept()
            accepted.close()  # the listener's side closes first: its end waits in TIME_WAIT
    with socket.socket() as bare, pytest.raises(OSError):
        bare.bind(("127.0.0.1", port))
    assert ports._bindable(port)
    _listen(port)


def test_a_held_port_is_not_handed_out() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        assert not ports._bindable(held.getsockname()[1])


class _SameDraws:
    """A random source that draws ``first`` twice, then ``second``: what a caller asking for two
    ports in a row (etcd's client and peer port) met now and then, about once in 12,000 calls."""

    def __init__(self, first: int, second: int) -> None:
        self.draws = [first, first, second]

    def randrange(self, lo: int, hi: int) -> int:
        return self.draws.pop(0)


def test_two_ports_asked_for_in_a_row_are_never_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither port is bound yet when the second is asked for, so a bind check alone would hand
    the same one out twice, and the process given both would fail with "address already in use"
    (an etcd in the fleet tests exited so, once, on CI)."""
    low = ports._ephemeral_low()
    first, second = low - 7, low - 9
    monkeypatch.setattr(random, "SystemRandom", lambda: _SameDraws(first, second))
    monkeypatch.setattr(ports, "_HANDED", deque(maxlen=8))
    assert (ports.free_port(), ports.free_port()) == (first, second)
