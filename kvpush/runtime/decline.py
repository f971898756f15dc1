"""``Decliner``: tell a peer, over its side channel, that this side cannot take a transfer.

When one leg of a request is refused, the other side would otherwise hold what it reserved for
it until a lease or deadline runs out (30 s by default): a small or refusing D would drain P's
pool and starve healthy Ds, and D would wait out its deadline when P refused. ``decline`` queues
a ``DeclineReq`` for the peer's side channel and returns at once; one worker thread sends them
(one client per peer address, a short timeout), so a dead or slow peer costs this endpoint
nothing but that thread's time. The side channel is used, not a NIXL notification, because a
refusal often comes before any NIXL connection exists (no free blocks, incompatible peers).

Best effort by design: a decline that cannot be delivered is counted and logged (rate-limited);
the lease or deadline on the other side still bounds what it holds. Threads: callers on any
thread; the ``decline`` worker.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading

import msgspec

from kvpush.address import parse_address
from kvpush.config import Role, Timeouts
from kvpush.errors import KvpushError
from kvpush.ratelog import RateLimitedLog
from kvpush.telemetry.names import Counter
from kvpush.telemetry.store import Telemetry
from kvpush.transport.client import SideChannelClient
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator
from kvpush.wire.side_messages import MAX_DECLINE_BATCH

log = logging.getLogger(__name__)

QUEUE = 4096  # declines waiting to be sent; more are dropped (and counted)
CLIENTS = 64  # peer connections kept open
SEND_TIMEOUT_S = 1.0


class Decliner:
    def __init__(
        self, auth: Authenticator, timeouts: Timeouts, telemetry: Telemetry | None = None
    ) -> None:
        self._auth = auth
        # A stand-in until the endpoint sets its rank 0's (never read: its role is any).
        self.telemetry = telemetry or Telemetry(Role.DECODE, "decliner")
        self._timeout = min(SEND_TIMEOUT_S, timeouts.side_channel_s)
        self._q: queue.Queue[tuple[str, protocol.DeclineReq] | None] = queue.Queue(QUEUE)
        self._clients: dict[str, SideChannelClient] = {}
        self._rl = RateLimitedLog(log)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="decline", daemon=True)
        self._thread.start()

    def decline(self, address: str, msg: protocol.DeclineReq) -> None:
        """Queue ``msg`` for the side channel at ``address`` (never blocks, never raises)."""
        if self._closed:
            return
        try:
            self._q.put_nowait((address, msg))
        except queue.Full:
            self.telemetry.inc(Counter.DECLINES_DROPPED)

    def close(self) -> None:
        """Send what is queued (each within its timeout), then stop."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=1.0)
        self._thread.join(self._timeout * 4 + 1)
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            stop = False
            items = [item]
            # What queued up while the last one was sent goes out together: D's declines to
            # one P for one reason in one DeclineReq, so a refusing D under load frees P's
            # blocks as fast as it refuses (one round trip per batch, not per transfer).
            while len(items) < QUEUE:
                try:
                    more = self._q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                items.append(more)
            for address, msg, n in batched(items):
                try:
                    self._send(address, msg)
                    self.telemetry.inc(Counter.DECLINES_SENT, n)
                except Exception as e:  # a peer that cannot be told: its lease still bounds it
                    self.telemetry.inc(Counter.DECLINES_DROPPED, n)
                    self._forget(address)
                    self._rl.warning(
                        "decline", "could not tell %s that %s (and %d more) are declined: %s",
                        address, msg.transfer_id, n - 1, e,
                    )  # fmt: skip
            if stop:
                return

    def _send(self, address: str, msg: protocol.DeclineReq) -> None:
        c = self._clients.get(address)
        if c is None:
            if len(self._clients) >= CLIENTS:
                self._forget(next(iter(self._clients)))
            host, port = parse_address(address)
            c = self._clients[address] = SideChannelClient(
                host, port, auth=self._auth, timeout_s=self._timeout
            )
        rep = c.request(msg, timeout_s=self._timeout)
        if isinstance(rep, protocol.ErrorRep):
            raise KvpushError(f"{rep.code}: {rep.message}")

    def _forget(self, address: str) -> None:
        c = self._clients.pop(address, None)
        if c is not None:
            c.close()


def batched(
    items: list[tuple[str, protocol.DeclineReq]],
) -> list[tuple[str, protocol.DeclineReq, int]]:
    """``(address, message, transfers)``: D's declines to one P address with one reason merged
    into one message of up to ``MAX_DECLINE_BATCH + 1`` transfers (P frees blocks by transfer
    id; the first one's detail stands for the batch); P's declines to D, which name D's
    request, go alone. Order kept (by each batch's first transfer)."""
    groups: list[tuple[str, protocol.DeclineReq, list[str]]] = []
    open_: dict[tuple[str, str], int] = {}  # merge key -> index in groups
    for address, msg in items:
        if msg.origin == Role.DECODE:
            k = (address, msg.reason)
            i = open_.get(k)
            if i is not None and len(groups[i][2]) < MAX_DECLINE_BATCH:
                groups[i][2].append(msg.transfer_id)
                continue
            open_[k] = len(groups)
        groups.append((address, msg, []))
    return [
        (a, msgspec.structs.replace(m, also=more) if more else m, 1 + len(more))
        for a, m, more in groups
    ]
