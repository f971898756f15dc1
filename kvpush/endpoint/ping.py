"""NIXL notification round trips between endpoints (``kvpush probe --ping``).

``Pinger.ping`` runs on the caller's thread: it sends ``Ping`` notifications to a peer and waits
for each answer. ``Pinger.on_ping`` is called on the role's owner thread for every Ping
notification: an answer resolves a waiting ping, a question is answered (after a notif-only
handshake back to the address it names, in the background like every handshake).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvpush.config import HandshakeMode
from kvpush.errors import KvpushError, PeerUnreachableError
from kvpush.peers.handshakes import HandshakeManager, PeerConn
from kvpush.transport.agent import Agent
from kvpush.wire import protocol
from kvpush.wire.notifs import Codec

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Pinger:
    agent: Agent
    handshakes: HandshakeManager
    codec: Codec
    reply_to: tuple[str, int, int]  # where a peer's answers go: this rank's side channel
    timeout_s: float  # how long one round trip may take
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _waiters: dict[int, Future[float]] = field(default_factory=dict, init=False)
    _seq: int = field(default=0, init=False)

    def ping(self, conn: PeerConn, count: int, poke: Callable[[], None]) -> list[float]:
        """``count`` round trips to ``conn`` (a first, warm-up trip is not counted)."""
        out: list[float] = []
        for i in range(count + 1):
            with self._lock:
                self._seq += 1
                seq = self._seq
                fut: Future[float] = Future()
                self._waiters[seq] = fut
            t0 = time.perf_counter()
            msg = protocol.Ping(
                seq=seq,
                reply_host=self.reply_to[0],
                reply_port=self.reply_to[1],
                reply_rank=self.reply_to[2],
                sent_at=time.time(),
            )
            self.agent.send_notif(conn.agent_name, self.codec.encode(msg))
            poke()
            try:
                t1 = fut.result(self.timeout_s)
            except TimeoutError:
                raise PeerUnreachableError(
                    f"{conn.address} did not answer NIXL ping {i} in time"
                ) from None
            finally:
                with self._lock:
                    self._waiters.pop(seq, None)
            if i > 0:
                out.append(t1 - t0)
        return out

    def on_ping(self, sender: str, msg: protocol.Ping) -> None:
        """Owner thread: resolve an answer, or answer a question."""
        if msg.reply:
            with self._lock:
                fut = self._waiters.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(time.perf_counter())
            return
        key = (msg.reply_host, msg.reply_port, msg.reply_rank)
        agent, codec = self.agent, self.codec

        def answer(conn: PeerConn) -> None:
            try:
                agent.send_notif(
                    conn.agent_name, codec.encode(protocol.Ping(seq=msg.seq, reply=True))
                )
            except KvpushError as e:
                log.debug("ping reply failed: %s", e)

        hs_fut = self.handshakes.ensure(key, HandshakeMode.NOTIF)
        if hs_fut is None:
            conn = self.handshakes.get(key)
            if conn is not None:
                answer(conn)
            return

        def done(f: Future[PeerConn]) -> None:
            if f.exception() is None:
                answer(f.result())

        hs_fut.add_done_callback(done)
