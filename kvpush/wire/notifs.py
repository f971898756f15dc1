"""Encoding and decoding of NIXL notifications, one codec per wire (pure; any thread).

``NotifCodec`` (kvpush's wire) seals outgoing notifications (HMAC when a token is set) and
size-checks, authenticates and decodes incoming ones into typed structs; vLLM's ``PUSH_REG:``
form is accepted only when no token is set. ``VllmNotifCodec`` (``--wire vllm``) speaks vLLM's
three forms only, into and out of the same typed structs; kvpush's own messages (failures,
cancels, fences, pings) are never sent to a vLLM peer: ``carries`` says which ones can be.
"""

from __future__ import annotations

from kvpush.errors import AuthError, ProtocolError
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import CH_NOTIF, Authenticator


class VllmNotifCodec:
    """vLLM 0.33's notification forms (``kvpush.wire.vllm``); no authentication exists there."""

    CARRIED = (protocol.PushReg, protocol.Completion, protocol.Heartbeat)

    def __init__(self, max_bytes: int = protocol.MAX_NOTIF_BYTES) -> None:
        self.max_bytes = max_bytes

    def carries(self, msg: protocol.Notif) -> bool:
        return isinstance(msg, self.CARRIED)

    def encode(self, msg: protocol.Notif) -> bytes:
        if isinstance(msg, protocol.PushReg):
            return vllm.encode_push_reg(msg)
        if isinstance(msg, protocol.Completion):
            return vllm.encode_completion(msg.request_id, msg.p_tp_size)
        if isinstance(msg, protocol.Heartbeat):
            return vllm.encode_heartbeat(list(msg.transfer_ids))
        raise ProtocolError(f"{type(msg).__name__} has no form on vLLM's wire")

    def decode(self, data: bytes) -> protocol.Notif:
        if len(data) > self.max_bytes:
            raise ProtocolError(
                f"notification of {len(data)} bytes exceeds the {self.max_bytes}-byte limit"
            )
        return vllm.decode_notif(data)


class NotifCodec:
    def __init__(self, auth: Authenticator, max_bytes: int = protocol.MAX_NOTIF_BYTES) -> None:
        self._auth = auth
        self.max_bytes = max_bytes

    def carries(self, msg: protocol.Notif) -> bool:
        return True

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


Codec = NotifCodec | VllmNotifCodec
