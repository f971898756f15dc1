"""The owner threads' shared pieces: the idle strategy and the notification drain.

``IdleWaiter`` implements the polling policy of a thread that owns a NIXL agent without a
progress thread: spin while work is pending, keep spinning briefly after activity, then back off
exponentially to ``idle_poll_max_us`` -- woken at once by inbox puts. ``drain_notifications``
fetches, decodes and dispatches every pending notification in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpush.config import AgentConfig
from kvpush.errors import AuthError, ProtocolError
from kvpush.runtime.ratelog import RateLimitedLog
from kvpush.telemetry.store import Telemetry
from kvpush.transport.nixl import NixlAgent, TransferError
from kvpush.wire import protocol
from kvpush.wire.notifs import NotifCodec

log = logging.getLogger(__name__)


class IdleWaiter:
    """Adaptive wait for a polling owner thread."""

    def __init__(self, wake: threading.Event, cfg: AgentConfig) -> None:
        self.wake = wake
        self.spin_s = cfg.busy_spin_us / 1e6
        self.max_s = cfg.idle_poll_max_us / 1e6
        self.min_s = min(50e-6, self.max_s)
        self._sleep = self.min_s
        self._last_busy = time.monotonic()

    def wait(self, busy: bool) -> None:
        now = time.monotonic()
        if busy:
            self._last_busy = now
            self._sleep = self.min_s
            return
        if now - self._last_busy < self.spin_s:
            time.sleep(0)  # yield the GIL to handshake / side-channel threads
            return
        if self.wake.wait(self._sleep):
            self._sleep = self.min_s
        else:
            self._sleep = min(self._sleep * 2, self.max_s)
        self.wake.clear()

    def force_wake(self) -> None:
        self.wake.set()


def drain_notifications(
    agent: NixlAgent,
    codec: NotifCodec,
    telemetry: Telemetry,
    rl: RateLimitedLog,
    handle: Callable[[str, protocol.Notif], None],
) -> int:
    """Fetch every pending notification, decode each and hand it to ``handle`` (owner thread).

    One place counts and logs each rejection kind: unauthenticated (``auth_rejected``),
    malformed or oversized (``malformed_notif``), a handler bug (``internal_error``). No input
    can raise out of here. Returns how many notifications were seen.
    """
    try:
        notifs = agent.get_notifs()
    except TransferError as e:
        rl.warning("notifs", "get_new_notifs failed: %s", e)
        return 0
    n = 0
    for sender, msgs in notifs.items():
        for data in msgs:
            n += 1
            telemetry.inc("notifs_received")
            try:
                msg = codec.decode(data)
            except AuthError as e:
                telemetry.fail("auth_rejected")
                rl.warning("auth", "rejected notification from %s: %s", sender, e)
                continue
            except ProtocolError as e:
                telemetry.fail("malformed_notif")
                rl.warning("malformed", "bad notification from %s: %s", sender, e)
                continue
            try:
                handle(sender, msg)
            except Exception:
                telemetry.fail("internal_error")
                log.exception("handling a notification from %s failed", sender)
    return n
