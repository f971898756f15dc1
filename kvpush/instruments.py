"""Test and measurement instruments of an endpoint: what no production endpoint carries.

``Instruments`` is one frozen record handed to ``open_endpoint`` (and on to every rank's
``EndpointContext``) by the tests and the measuring tools only; the serve commands never build
one, so a production endpoint runs with ``NO_INSTRUMENTS`` and its ``EndpointConfig`` has no
field for any of them:

* ``handshake_reply_delay_s``: the side channel answers handshakes this late (a slow new peer);
* ``crash_rank_after``: ``(rank, n)``: that rank's owner loop dies after its n-th transfer
  (P: finished, D: new request), as a bug would kill it; ``(-1, 0)``: off;
* ``start_delay_s``: the side channel answers "starting" this long before the ranks are built
  (a slow start, e.g. a large GPU pool to register);
* ``writer``: P's writer waits for a new peer's handshake inside its loop (``BLOCKING``) instead
  of parking the push (``DEFERRED``, the only production mode): kept to measure the difference;
* ``drop_agents_after``: after its n-th successful push, P's NIXL forgets every connected D's
  agent under it (a transport lost on an established peer, checked after every push); 0: off.

A pure value: no thread of its own; read by whichever thread checks a hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class WriterMode(str, Enum):
    """How P's writer waits for a new peer's handshake (``kvpush.prefill.strategy``)."""

    DEFERRED = "deferred"
    BLOCKING = "blocking"


@dataclass(frozen=True)
class Instruments:
    """Hooks for tests and measurements (see the module docstring); all off by default."""

    handshake_reply_delay_s: float = 0.0
    crash_rank_after: tuple[int, int] = (-1, 0)
    start_delay_s: float = 0.0
    writer: WriterMode = WriterMode.DEFERRED
    drop_agents_after: int = 0


NO_INSTRUMENTS = Instruments()
