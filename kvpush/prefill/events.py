"""What P's collaborators return for the writer to act on, instead of calling back up.

``Legs`` posts and polls WRITEs; when one of its calls finds that a peer must be forgotten
(``EvictPeer``) or that a push's blocks must wait again (``Rewait``), it says so in its return
value and the writer (``kvpush.prefill.writer``) dispatches it -- the eviction then ends that
peer's legs through ``Legs`` again, from the top, never from inside a ``Legs`` call. ``ENDED``
is the answer of a poll that ended its entry with nothing more to do (one shared instance: the
hot path allocates nothing for it).

Pure data; made and read on the writer's owner thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.peers.handshakes import PeerKey
from kvpush.prefill.table import Finished


@dataclass(frozen=True, slots=True)
class Ended:
    """A polled WRITE (or fence) ended: completed, failed or timed out."""


ENDED = Ended()


@dataclass(frozen=True, slots=True)
class EvictPeer:
    """The peer at ``key`` must be forgotten (its entry ended too). ``soft``: it may still be
    alive (a transport error, not its death): its legs are abandoned as bytes that may still
    land and its fences stay owed; otherwise it is dead and its fences are forgotten."""

    key: PeerKey
    reason: str
    soft: bool


@dataclass(frozen=True, slots=True)
class Rewait:
    """The push's PUSH_REG was refused (forged): its finished blocks wait again."""

    finished: Finished


Event = EvictPeer | Rewait
NO_EVENTS: tuple[Event, ...] = ()
