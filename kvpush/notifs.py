"""Encoding and decoding of NIXL notifications, and the owner threads' idle strategy.

``NotifCodec`` seals outgoing notifications (HMAC when a token is set) and size-checks,
authenticates and decodes incoming ones into typed structs; vLLM's ``PUSH_REG:`` form is
accepted only when no token is set. ``IdleWaiter`` implements the polling policy of threads that
own a NIXL agent without a progress thread: spin while work is pending, keep spinning briefly
after activity, then back off exponentially to ``idle_poll_max_us`` -- woken at once by inbox puts.
"""

from __future__ import annotations

import threading
import time

from kvpush import protocol
from kvpush.auth import CH_NOTIF, Authenticator
from kvpush.config import AgentConfig
from kvpush.errors import AuthError, ProtocolError


class NotifCodec:
    def __init__(self, auth: Authenticator, max_bytes: int = protocol.MAX_NOTIF_BYTES) -> None:
        self._auth = auth
        self.max_bytes = max_bytes

    def encode(self, msg: protocol.Notif) -> bytes:
        return protocol.MAGIC_NOTIF + self._auth.seal(CH_NOTIF, protocol.encode(msg))

    def decode(self, data: bytes) -> protocol.Notif:
        """Raise ``ProtocolError`` (malformed/oversized) or ``AuthError`` (unauthenticated)."""
        if len(data) > self.max_bytes:
            raise ProtocolError(
                f"notification of {len(data)} bytes exceeds the {self.max_bytes}-byte limit"
            )
        if data.startswith(protocol.VLLM_PUSH_REG_PREFIX):
            if self._auth.enabled:
                raise AuthError("unauthenticated vLLM-form PUSH_REG refused: a token is set")
            return protocol.decode_vllm_push_reg(data)
        env = protocol.decode_envelope(data, protocol.MAGIC_NOTIF, self.max_bytes, "notification")
        body = self._auth.open(CH_NOTIF, env)
        return protocol.decode_notif_body(body)


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
