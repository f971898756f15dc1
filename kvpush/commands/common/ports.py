"""Ports for processes a tool starts and points others at later (vLLM's side channel in ``bench
peer``, etcd in ``bench fleet``; test endpoints that restart at the same address).

A port taken with ``bind(port 0)`` comes from the kernel's *ephemeral* range (32768-60999 here),
the range every outgoing connection on the host draws its local port from. Released, it can be
handed to some other process's connection at any moment -- a UCX connection, a ZMQ client, a
parallel test -- and a process that binds it later fails with "address already in use" (seen in
the fault soak with other work on the host, and in ``bench peer``: vLLM's D binds its side
channel a minute after its port was chosen, once vLLM is imported, and found it taken). These
ports come from just below that range, where the kernel never assigns one by itself, and are
checked free (for a listener that sets SO_REUSEADDR, as ZMQ does) before they are handed out.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

_SPAN = 12000  # how far below the ephemeral range to draw from
# Ports this process handed out lately: a caller that asks for two ports before it binds either
# (etcd's client and peer port) must never get the same one twice.
_HANDED: deque[int] = deque(maxlen=512)
_HANDED_LOCK = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody holds now and that the kernel never hands out to
    an outgoing connection (below the ephemeral range); port 0's pick where none is found."""
    low = _ephemeral_low()
    lo, hi = max(1024, low - _SPAN), low
    rng = random.SystemRandom()
    with _HANDED_LOCK:
        for _ in range(64):
            port = rng.randrange(lo, hi)
            if port not in _HANDED and _bindable(port):
                _HANDED.append(port)
                return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _HANDED.append(port)
        return port
