"""How P's writer waits for a P->D handshake: never (``DeferredWait``), or inline (blocking).

``DeferredWait`` (the default) parks the push in the table, attaches a done-callback to the
handshake future and returns at once: the callback, on the handshake thread, hands the push back
to the writer through its *deferred* inbox (``OwnerThread.hand_off``: if even that fails, the
writer fails the push on its next pass, so nothing is lost silently). ``BlockingWait`` waits for
the future on the writer thread: the old head-of-line behaviour in which one slow new D stalls
every push, kept only to measure the difference (``Instruments.writer``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvpush.peers.handshakes import PeerConn
from kvpush.prefill.table import Push, PushTable
from kvpush.runtime.inbox import Inbox
from kvpush.runtime.owner import OwnerThread


@dataclass(frozen=True)
class Deferred:
    """A push whose handshake finished (``error`` set when it failed)."""

    push: Push
    error: BaseException | None


class HandshakeWait(Protocol):
    def pending(self, push: Push, fut: Future[PeerConn]) -> bool:
        """True: the handshake is done, go on. False: the push was parked and comes back
        later. Raises the handshake's error (the writer fails the push)."""


class DeferredWait:
    def __init__(
        self,
        table: PushTable,
        owner: OwnerThread,
        inbox: Callable[[], Inbox[Deferred]],
        on_lost: Callable[[Push, BaseException], None],
    ) -> None:
        self._table = table
        self._owner = owner
        self._inbox = inbox
        self._on_lost = on_lost

    def pending(self, push: Push, fut: Future[PeerConn]) -> bool:
        self._table.await_handshake(push)
        nxt = push.retry()
        fut.add_done_callback(lambda f: self._done(nxt, f))
        return False

    def _done(self, push: Push, fut: Future[PeerConn]) -> None:
        """Runs on the handshake thread: queue the push for the writer; never lose it."""
        try:
            item = Deferred(push, fut.exception())
        except BaseException as e:
            item = Deferred(push, e)
        self._owner.hand_off(self._inbox(), item, lambda e: self._on_lost(push, e))


class BlockingWait:
    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s

    def pending(self, push: Push, fut: Future[PeerConn]) -> bool:
        # Head-of-line on purpose: every other push waits behind this handshake.
        fut.result(self._timeout_s)
        return True
