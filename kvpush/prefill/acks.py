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

An acknowledgement goes only to the D agent that cancelled (the incarnation at that address when
the Cancel came): sent over the connection of an incarnation that died since, it is lost; and
when P evicts a D rank's connection, only what it owed to that connection's agent is dropped --
what a newer incarnation at the same address is owed stays, and P handshakes to it. An
acknowledgement whose incarnation P finds replaced (P connected to another one at that address
after the Cancel came) has nobody left to free blocks for: dropped, not counted.

Runs on the writer thread; a handshake's completion comes back through the tasks inbox.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Owed:
    """One acknowledgement owed: to the agent whose Cancel it answers, since ``t_owed``."""

    ack: protocol.Failure
    agent: str  # the D agent that cancelled (one incarnation of that D rank)
    t_owed: float  # wall clock, as a connection's ``connected_at``


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
        self._owed: dict[PeerKey, list[Owed]] = {}
        self._attempts: dict[PeerKey, int] = {}
        self._due: dict[PeerKey, float] = {}  # next handshake for a rank whose last failed
        self._pending: set[PeerKey] = set()  # a handshake is under way
        self._n = 0

    @property
    def n_owed(self) -> int:
        return self._n

    def add(self, key: PeerKey, ack: protocol.Failure, agent: str) -> None:
        """Owe ``ack`` to ``agent``, D rank ``key``'s incarnation that cancelled: send it once a
        connection to it is up."""
        if self._n >= MAX_OWED_ACKS:
            self._ctx.telemetry.fail(Failure.CANCEL_UNACKNOWLEDGED)
            return
        self._owed.setdefault(key, []).append(Owed(ack, agent, time.time()))
        self._n += 1
        if key not in self._due:  # else: its back-off decides when to try again
            self._connect(key)

    def retry(self, now: float) -> None:
        """Housekeeping: handshake again to the ranks whose back-off is over."""
        for key, t in list(self._due.items()):
            if now >= t:
                del self._due[key]
                self._connect(key)

    def forget(self, key: PeerKey, conn: PeerConn | None) -> None:
        """P evicted D rank ``key``'s connection ``conn`` (None: it had none): what was owed to
        its agent is dropped (that incarnation is gone or will be connected afresh); what a
        newer incarnation is owed stays, and P handshakes to it now."""
        owed = self._owed.get(key, [])
        if conn is None or all(o.agent == conn.agent_name for o in owed):
            self._drop(key, counted=False)
            return
        keep = [o for o in owed if o.agent != conn.agent_name]
        self._n -= len(owed) - len(keep)
        self._owed[key] = keep
        self._attempts.pop(key, None)
        self._due.pop(key, None)
        self._connect(key)

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
        if conn is None:
            self._failed(key)
            return
        owed = self._owed.get(key, [])
        later: list[Owed] = []  # owed to a newer incarnation than the one connected
        while owed:
            o = owed[0]
            if o.agent != conn.agent_name:
                if conn.connected_at <= o.t_owed:
                    later.append(o)  # P still holds an older incarnation's connection
                else:
                    self._n -= 1  # replaced since it cancelled: nobody waits for this
                owed.pop(0)
                continue
            if not self._notify(conn, o.ack):
                owed[:0] = later
                self._failed(key)
                return
            owed.pop(0)
            self._n -= 1
        if later:
            self._owed[key] = later
            self._failed(key)  # handshake again later: the old connection goes meanwhile
            return
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
