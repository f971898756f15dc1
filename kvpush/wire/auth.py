"""Message authentication: HMAC-SHA256 over every envelope, with replay protection.

Without a token, envelopes carry no tag and everything is accepted (the side channel then binds
loopback by default). With a token every side-channel request and reply and every notification
kvpush acts on must carry a valid tag over (channel, timestamp, nonce, body); a timestamp outside
the window or a nonce seen before is rejected. Thread-safe: the side-channel thread and the
writer/receiver threads share one instance.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict

from kvpush.errors import AuthError, ConfigError
from kvpush.wire import protocol

CH_REQUEST = b"req"
CH_REPLY = b"rep"
CH_NOTIF = b"notif"


def load_token_file(path: str) -> bytes:
    """Read a shared token; refuse files other users can read."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(
            f"cannot read auth token file {path}: {e.strerror}", "check the path and permissions"
        ) from None
    if st.st_mode & 0o007:
        raise ConfigError(
            f"auth token file {path} is readable by other users",
            f"run: chmod 600 {path}",
        )
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read auth token file {path}: {e.strerror}", "") from None
    if len(token) < 16:
        raise ConfigError(
            f"auth token in {path} is shorter than 16 bytes",
            "generate one: head -c 32 /dev/urandom | xxd -p > FILE && chmod 600 FILE",
        )
    return token


class Authenticator:
    """Seals and opens envelopes for one endpoint or client."""

    def __init__(
        self, token: bytes | None, window_s: float = 60.0, max_nonces: int = 1_000_000
    ) -> None:
        self._key = hashlib.sha256(b"kvpush-hmac-v1|" + token).digest() if token else None
        self.window_s = window_s
        self._max_nonces = max_nonces
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, channel: bytes, ts: float, nonce: bytes, body: bytes) -> bytes:
        assert self._key is not None
        m = hmac.new(self._key, digestmod=hashlib.sha256)
        m.update(channel)
        m.update(b"|%r|" % ts)
        m.update(nonce)
        m.update(b"|")
        m.update(body)
        return m.digest()

    def seal(self, channel: bytes, body: bytes) -> bytes:
        """Envelope bytes (without magic) for ``body`` on ``channel``."""
        ts = time.time()
        if self._key is None:
            return protocol.make_envelope_bytes(body, ts=ts)
        nonce = os.urandom(16)
        return protocol.make_envelope_bytes(
            body, tag=self._mac(channel, ts, nonce, body), ts=ts, nonce=nonce
        )

    def open(self, channel: bytes, env: protocol.Envelope) -> bytes:
        """Return the body of a verified envelope, or raise ``AuthError``."""
        if self._key is None:
            return env.body
        if not env.tag:
            raise AuthError("message has no authentication tag")
        if not hmac.compare_digest(env.tag, self._mac(channel, env.ts, env.nonce, env.body)):
            raise AuthError("message has a bad authentication tag")
        now = time.time()
        if abs(now - env.ts) > self.window_s:
            raise AuthError(
                f"message timestamp is {now - env.ts:+.1f}s off (window {self.window_s:.0f}s)",
                "check the clocks of both hosts (NTP)",
            )
        with self._lock:
            if env.nonce in self._seen:
                raise AuthError("replayed message (nonce seen before)")
            self._seen[env.nonce] = env.ts
            cutoff = now - self.window_s
            while self._seen and (
                len(self._seen) > self._max_nonces or next(iter(self._seen.values())) < cutoff
            ):
                self._seen.popitem(last=False)
        return env.body
