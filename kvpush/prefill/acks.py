"""Cancel acknowledgements P owes a D rank it holds no connection to, until they are delivered.

D keeps the blocks of a request it cancelled quarantined until P says nothing more can land: a
WRITE's completion, a fence, or a ``Failure(cancelled, may_have_written=False)`` -- the
acknowledgement. When P holds no connection to that D rank (it restarted, or P evicted it), the
acknowledgement needs a handshake first; a handshake that failed once (a D busy starting, a
side channel slower than its timeout under load) used to drop it, and D's blocks then stayed
quarantined for as long as P lived. ``OwedAcks`` keeps them per D rank and handshakes again
(back-off ``retry_s`` x attempt) until they are sent, for at most ``MAX_ATTEMPTS`` handshakes;
what is still owed after that is counted ``cancel_unacknowledged``. Bounded: at most
``MAX_OWED_ACKS`` acknowledgements owed at once (beyond it, counted and dropped).

Runs on the writer thread; a handshake's completion comes back through the tasks inbox.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from kvpush.config import HandshakeMode
from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.prefill.context import WriterContext
from kvpush.runtime.inbox import Inbox
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol

#: Handshakes tried for the acknowledgements owed to one D rank before they are given up.
MAX_ATTEMPTS = 6
#: Acknowledgements owed at once, over every D rank.
MAX_OWED_ACKS = 4096


class OwedAcks:
    def __init__(
        self,
        ctx: WriterContext,
        owner: OwnerThread,
        tasks: Inbox[Callable[[], None]],
        notify: Callable[[PeerConn, protocol.Notif], bool],
        retry_s: float,
    ) -> None:
        self._ctx = ctx
        self._owner = owner
        self._tasks = tasks
        self._notify = notify
        self._retry_s = max(retry_s, 0.05)
        self._owed: dict[PeerKey, list[protocol.Failure]] = {}
        self._attempts: dict[PeerKey, int] = {}
        self._due: dict[PeerKey, float] = {}  # next handshake for a rank whose last failed
        self._pending: set[PeerKey] = set()  # a handshake is under way
        self._n = 0

    @property
    def n_owed(self) -> int:
        return self._n

    def add(self, key: PeerKey, ack: protocol.Failure) -> None:
        """Owe ``ack`` to D rank ``key``: send it once a connection to it is up."""
        if self._n >= MAX_OWED_ACKS:
            self._ctx.telemetry.fail(Failure.CANCEL_UNACKNOWLEDGED)
            return
        self._owed.setdefault(key, []).append(ack)
        self._n += 1
        if key not in self._due:  # else: its back-off decides when to try again
            self._connect(key)

    def retry(self, now: float) -> None:
        """Housekeeping: handshake again to the ranks whose back-off is over."""
        for key, t in list(self._due.items()):
            if now >= t:
                del self._due[key]
                self._connect(key)

    def forget(self, key: PeerKey) -> None:
        """D rank ``key`` is gone (its process ended): nothing of it waits for these."""
        self._drop(key, counted=False)

    def _connect(self, key: PeerKey) -> None:
        if key in self._pending:
            return
        fut = self._ctx.handshakes.ensure(key, HandshakeMode.FULL)
        if fut is None:  # connected already (or the handshake ended at once)
            self._flush(key)
            return
        self._pending.add(key)

        def done(f: Future[PeerConn]) -> None:  # a handshake thread: back to the writer
            failed = f.exception() is not None
            self._owner.hand_off(
                self._tasks,
                lambda: self._handshake_done(key, failed),
                lambda e: self._ctx.telemetry.fail(Failure.CANCEL_UNACKNOWLEDGED),
            )

        fut.add_done_callback(done)

    def _handshake_done(self, key: PeerKey, failed: bool) -> None:
        self._pending.discard(key)
        if failed:
            self._failed(key)
        else:
            self._flush(key)

    def _flush(self, key: PeerKey) -> None:
        conn = self._ctx.handshakes.get(key)
        acks = self._owed.get(key, [])
        if conn is None:
            self._failed(key)
            return
        while acks:
            if not self._notify(conn, acks[0]):
                self._failed(key)
                return
            acks.pop(0)
            self._n -= 1
        self._owed.pop(key, None)
        self._attempts.pop(key, None)

    def _failed(self, key: PeerKey) -> None:
        if key not in self._owed:
            return
        n = self._attempts.get(key, 0) + 1
        if n >= MAX_ATTEMPTS:
            self._drop(key, counted=True)
            return
        self._attempts[key] = n
        self._due[key] = time.monotonic() + self._retry_s * n

    def _drop(self, key: PeerKey, counted: bool) -> None:
        acks = self._owed.pop(key, [])
        self._n -= len(acks)
        self._attempts.pop(key, None)
        self._due.pop(key, None)
        if counted:
            for _ in acks:
                self._ctx.telemetry.fail(Failure.CANCEL_UNACKNOWLEDGED)
