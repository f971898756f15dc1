"""Ports handed to processes that bind them later come from below the kernel's ephemeral range,
where no outgoing connection can take them in the meantime (``kvpush.commands.common.ports``)."""

from __future__ import annotations

import socket

from kvpush.commands.common import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_held_port_is_not_handed_out() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        assert not ports._bindable(held.getsockname()[1])
