"""Message authentication: HMAC-SHA256 over every envelope, with replay protection.

Without a token, envelopes carry no tag and everything is accepted (the side channel then binds
loopback by default). With a token every side-channel request and reply and every notification
kvpush acts on must carry a valid tag over (channel, timestamp, nonce, body); a timestamp outside
the window or a nonce seen before is rejected. Thread-safe: the side-channel thread and the
writer/receiver threads share one instance.

Owns also ``read_secret_file``: the one reader of a secret kept in a file (the token here, the
etcd password in ``kvpush.fleet.config``), which refuses a file other users can reach and words
its errors the caller's way (``SecretFileWords``). Pure file reads, on the caller's thread.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvpush.errors import AuthError, ConfigError
from kvpush.wire import protocol

CH_REQUEST = b"req"
CH_REPLY = b"rep"
CH_NOTIF = b"notif"


@dataclass(frozen=True)
class SecretFileWords:
    """How a caller's errors speak of its secret file: each a (message, hint) pair of templates
    over ``{path}``, ``{strerror}`` (the system's words), ``{error}`` (the exception's name) and
    ``{mode}`` (the file's permission bits, an int)."""

    missing: tuple[str, str]  # the file cannot be looked at (no such file, no access)
    loose: tuple[str, str]  # other users may reach it
    unreadable: tuple[str, str]  # it cannot be read
    not_regular: tuple[str, str] | None = None  # None: whatever is there is read

    def error(
        self, words: tuple[str, str], path: str, e: Exception | None = None, mode: int = 0
    ) -> ConfigError:
        """The ConfigError of ``words`` (one of the pairs above) for ``path``."""
        strerror = e.strerror if isinstance(e, OSError) else ""
        said = {"path": path, "strerror": strerror, "error": type(e).__name__, "mode": mode}
        return ConfigError(words[0].format(**said), words[1].format(**said))


def read_secret_file(path: str, words: SecretFileWords) -> bytes:
    """The bytes in ``path``; refused (``words``' ConfigError) unless the file is private to its
    owner (no access for other users), and, where ``words`` says so, a regular file. The
    errors name the file, never its content."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise words.error(words.missing, path, e) from None
    if words.not_regular is not None and not stat.S_ISREG(st.st_mode):
        raise words.error(words.not_regular, path)
    if st.st_mode & 0o007:
        raise words.error(words.loose, path, mode=stat.S_IMODE(st.st_mode))
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise words.error(words.unreadable, path, e) from None


_TOKEN_FILE = SecretFileWords(
    missing=("cannot read auth token file {path}: {strerror}", "check the path and permissions"),
    loose=("auth token file {path} is readable by other users", "run: chmod 600 {path}"),
    unreadable=("cannot read auth token file {path}: {strerror}", ""),
)


def load_token_file(path: str) -> bytes:
    """Read a shared token; refuse files other users can read."""
    token = read_secret_file(path, _TOKEN_FILE).strip()
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
