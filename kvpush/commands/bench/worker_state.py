"""What one bench worker hosts (``kvpush.commands.bench.worker``): at most one endpoint, one raw
NIXL node and one device-copy buffer, each in a ``Slot`` that names what is missing when a
command needs it before it was made (``start_endpoint``, ``raw_node`` / ``raw_pool_node``).

The endpoint's type is what ``kvpush.endpoint.open_endpoint`` returns (a P or a D endpoint),
taken from that function for the type checker only: a worker starts without importing the
engine (seconds), and only the command that opens an endpoint pays for it.

Threads: the worker's command threads (a slot is set by one command, read by the next ones).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from kvpush.errors import KvpushError

if TYPE_CHECKING:
    import torch

    from kvpush.commands.bench.raw_node import RawNode

T = TypeVar("T")


class Slot(Generic[T]):
    """One thing a worker may host, or nothing yet. ``made_by``: the function that makes it,
    for its type only (never called here)."""

    def __init__(self, what: str, hint: str, made_by: Callable[..., T] | None = None) -> None:
        self._what = what
        self._hint = hint
        self._value: T | None = None

    def put(self, value: T) -> None:
        self._value = value

    def get(self) -> T:
        """What is held, or a typed error naming the command that makes it."""
        v = self._value
        if v is None:
            raise KvpushError(f"this worker holds no {self._what}", self._hint)
        return v

    def peek(self) -> T | None:
        return self._value

    def take(self) -> T | None:
        """What is held (or None), the slot emptied."""
        v, self._value = self._value, None
        return v


class WorkerState:
    """What this worker hosts: at most one endpoint, one raw node, one device-copy buffer."""

    def __init__(self) -> None:
        if TYPE_CHECKING:
            from kvpush.endpoint import open_endpoint

            self.endpoint = Slot("endpoint", "start_endpoint first", made_by=open_endpoint)
        else:
            self.endpoint = Slot("endpoint", "start_endpoint first")
        self.raw: Slot[RawNode] = Slot("raw NIXL node", "raw_node or raw_pool_node first")
        self.copy_dst: torch.Tensor | None = None  # kvpush.commands.bench.devcopy's buffer
        self.stopping = threading.Event()
