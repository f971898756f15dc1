"""``bench peer``'s vLLM driver refuses a side-channel port it cannot bind, before vLLM's listener
thread would die on it and leave start-up waiting forever."""

from __future__ import annotations

import socket

import pytest

from kvpush.commands.bench.peer_vllm import driver
from kvpush.commands.common.ports import free_port


def test_a_port_someone_listens_on_is_refused_with_its_cause() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"side-channel port {port} cannot be bound"):
            driver.check_bindable(port)


def test_a_free_port_passes() -> None:
    driver.check_bindable(free_port())
