"""Encoding and decoding of NIXL notifications (pure; any thread).

``NotifCodec`` seals outgoing notifications (HMAC when a token is set) and size-checks,
authenticates and decodes incoming ones into typed structs; vLLM's ``PUSH_REG:`` form is
accepted only when no token is set.
"""

from __future__ import annotations

from kvpush.errors import AuthError, ProtocolError
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import CH_NOTIF, Authenticator


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
        if data.startswith(vllm.PUSH_REG_PREFIX):
            if self._auth.enabled:
                raise AuthError("unauthenticated vLLM-form PUSH_REG refused: a token is set")
            return vllm.decode_push_reg(data)
        env = protocol.decode_envelope(data, protocol.MAGIC_NOTIF, self.max_bytes, "notification")
        body = self._auth.open(CH_NOTIF, env)
        return protocol.decode_notif_body(body)
