"""Deadline-bound side-channel clients, and safe first contact.

``SideChannelClient`` uses a DEALER socket with request ids and a poller: a timed-out request
never wedges the socket (a REQ socket would be), and late replies are discarded by id. Its first
message on every connection is vLLM's ``get_meta_msg`` (``identify``): only a peer that answers
as kvpush is sent kvpush's framing. A client belongs to one thread.

A connection ZMQ has not made within ``LOOK_AFTER_S`` (0.1 s) is looked at once with a plain
TCP connection (``kvpush.transport.contact``): a refused port is ``PeerUnreachableError`` at
once, and a peer that answers but is no ZMQ socket at all -- an HTTP server, a banner -- is
``PeerError`` at once ("looks like HTTP"), instead of waiting out the deadline and saying it
"did not accept a connection". A handshake whose ZMQ connection completes within 0.1 s never
looks.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import msgspec
import zmq

from kvpush import PROTOCOL_VERSION
from kvpush.address import format_address
from kvpush.errors import (
    AuthError,
    IncompatiblePeerError,
    PeerError,
    PeerShuttingDownError,
    PeerTimeoutError,
    PeerUnreachableError,
    ProtocolError,
    WrongWireError,
)
from kvpush.transport.contact import ANSWERED_NOT_ZMQ, Contact, contact
from kvpush.transport.sidechannel import context
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import CH_REPLY, CH_REQUEST, Authenticator


@dataclass(frozen=True)
class PeerIdentity:
    """Who answered a first contact (``get_meta_msg`` for one rank), and when.

    ``kind`` is ``kvpush`` when the answer carries kvpush's identity map, else ``vllm``. Times
    are this process's ``perf_counter``; ``remote_clock`` is the peer's (vLLM: perf_counter,
    meaningful on the same host only).
    """

    address: str
    ranks: tuple[int, int]
    payload: vllm.HandshakePayload
    remote_clock: float
    t_send: float
    t_recv: float

    @property
    def kind(self) -> str:
        return "kvpush" if self.payload.kvpush is not None else "vllm"

    @property
    def kvpush(self) -> vllm.KvpushIdentity | None:
        return self.payload.kvpush

    @property
    def rtt_s(self) -> float:
        return self.t_recv - self.t_send


NOT_A_SIDE_CHANNEL_HINT = "check the address: it must be a kvpush or vLLM NIXL side channel"
#: A connection ZMQ has not made by then is looked at once with a plain TCP connection.
LOOK_AFTER_S = 0.1
#: The look's bounds: all of it, and the wait for a ZMTP greeting before the HTTP probe (a live
#: ZMQ peer greets within one round trip; one that does not is asked in HTTP).
LOOK_S = 1.5
LOOK_GREETING_S = 0.25


def not_zmq_error(c: Contact, host: str, port: int) -> PeerError | PeerUnreachableError | None:
    """The error a raw look at ``host:port`` proves at once (refused; answered, but not as
    ZMQ), else None: a ZMQ greeting, a timeout or silence are left to the caller's deadline."""
    if c.kind == "refused":
        return PeerUnreachableError(
            f"{c.address}: connection refused",
            f"nothing listens on port {port} of {host}: check the port and that the peer runs",
        )
    if c.kind in ANSWERED_NOT_ZMQ:
        return PeerError(
            f"{c.address} answered but is not a kvpush or vLLM side channel ({c.detail})",
            NOT_A_SIDE_CHANNEL_HINT,
        )
    return None


class SideChannelClient:
    """A deadline-bound client for one peer; owned by one thread (not thread-safe).

    First contact is always safe for a vLLM engine: before its first kvpush request on a
    connection the client sends vLLM's ``get_meta_msg`` (``identify``) and goes on only if the
    answer says kvpush. A vLLM peer gets nothing else: ``WrongWireError``.
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        host: str,
        port: int,
        *,
        auth: Authenticator | None = None,
        timeout_s: float = 5.0,
        max_frame_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._auth = auth or Authenticator(None)
        self._max = max_frame_bytes
        self._sock: zmq.Socket[bytes] | None = None
        self.identity: PeerIdentity | None = None  # of the current connection

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            s = context().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, self._max)
            s.setsockopt(zmq.IMMEDIATE, 1)
            if ":" in self.host:
                s.setsockopt(zmq.IPV6, 1)
            host = f"[{self.host}]" if ":" in self.host else self.host
            s.connect(f"tcp://{host}:{self.port}")
            self._sock = s
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self.identity = None

    def __enter__(self) -> SideChannelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sending / receiving
    def _send(self, payload: bytes, deadline: float, timeout: float) -> zmq.Socket[bytes]:
        sock = self._socket()
        looked = False
        t0 = time.monotonic()
        while True:
            try:
                # [b"", payload]: exactly what a REQ socket sends, so a ROUTER sees 3 frames.
                sock.send_multipart([b"", payload], zmq.NOBLOCK)
                return sock
            except zmq.Again:
                # IMMEDIATE: no connection completed yet; wait for it within the deadline.
                left = deadline - time.monotonic()
                if left <= 0:
                    self._reset()
                    raise PeerTimeoutError(
                        f"{self.address} did not accept a connection within {timeout:g}s"
                    ) from None
                if not looked and time.monotonic() - t0 >= LOOK_AFTER_S:
                    # ZMQ retries a refused port, and an HTTP server's, quietly until the
                    # deadline; one plain TCP look tells either at once (as probe's does).
                    looked = True
                    c = contact(
                        self.host, self.port, min(left, LOOK_S), greeting_wait_s=LOOK_GREETING_S
                    )
                    err = not_zmq_error(c, self.host, self.port)
                    if err is not None:
                        self._reset()
                        raise err from None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        continue  # the deadline's error, above
                sock.poll(int(min(left, 0.05) * 1000) + 1, zmq.POLLOUT)

    def _recv(self, sock: zmq.Socket[bytes], deadline: float, timeout: float) -> list[bytes]:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            self._reset()
            raise PeerTimeoutError(f"{self.address} did not answer within {timeout:g}s")
        return sock.recv_multipart()

    # ------------------------------------------------------------------ first contact
    def identify(
        self, pp_rank: int = 0, tp_rank: int = 0, timeout_s: float | None = None
    ) -> PeerIdentity:
        """Send vLLM's ``get_meta_msg`` for one rank and read who answered.

        Raises ``PeerTimeoutError`` on timeout and ``ProtocolError`` when the answer is in
        neither kvpush's nor vLLM's form. Sets ``identity`` for the connection.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        sock = self._send(vllm.get_meta_request(pp_rank, tp_rank), deadline, timeout)
        t0 = time.perf_counter()
        while True:
            frames = self._recv(sock, deadline, timeout)
            t1 = time.perf_counter()
            if frames and frames[-1].startswith(protocol.MAGIC_REP):
                continue  # a late kvpush reply to an earlier request on this connection
            try:
                payload, clock = vllm.decode_get_meta_reply(frames)
            except ProtocolError as e:
                self._reset()
                raise ProtocolError(
                    f"{self.address} answered, but not as a kvpush or vLLM side channel: {e}",
                    NOT_A_SIDE_CHANNEL_HINT,
                ) from None
            ident = PeerIdentity(self.address, (pp_rank, tp_rank), payload, clock, t0, t1)
            self.identity = ident
            return ident

    def _ensure_kvpush(self, timeout: float) -> None:
        """Identify the peer once per connection; only a kvpush peer gets kvpush framing."""
        ident = self.identity or self.identify(timeout_s=timeout)
        kv = ident.kvpush
        if kv is None:
            self._reset()
            raise WrongWireError(
                f"{self.address} is a vLLM NIXL side channel, not a kvpush endpoint "
                f"(compatibility hash {ident.payload.compatibility_hash[:16] or '?'}); "
                "nothing but get_meta_msg was sent to it",
                "vllm",
                "to stand in for a vLLM peer, start kvpush with --wire vllm; "
                f"'kvpush probe {self.address}' shows what it is",
            )
        if kv.protocol != PROTOCOL_VERSION:
            self._reset()
            raise IncompatiblePeerError(
                f"{self.address} is kvpush speaking protocol v{kv.protocol}, "
                f"this kvpush speaks v{PROTOCOL_VERSION}",
                [("protocol_version", PROTOCOL_VERSION, kv.protocol)],
                "run the same kvpush version on both sides",
            )
        if kv.auth and not self._auth.enabled:
            self._reset()
            raise AuthError(
                f"{self.address} is a kvpush endpoint that requires an auth token",
                "pass --auth-token-file with the token the peer uses",
            )

    # ------------------------------------------------------------------ kvpush requests
    def request(
        self, req: protocol.SideRequest, timeout_s: float | None = None
    ) -> protocol.SideReply:
        """Send one request and wait for its reply until the deadline.

        Raises ``PeerTimeoutError`` on timeout, ``WrongWireError`` for a vLLM peer,
        ``ProtocolError``/``AuthError`` on a bad reply and ``PeerError`` when the peer answered
        with an error.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        self._ensure_kvpush(timeout)
        rid = next(self._ids)
        req = msgspec.structs.replace(req, rid=rid)
        env = self._auth.seal(CH_REQUEST, protocol.encode(req))
        nonce = protocol.decode_envelope(
            protocol.MAGIC_REQ + env, protocol.MAGIC_REQ, 1 << 30, "request"
        ).nonce
        sock = self._send(protocol.MAGIC_REQ + env, deadline, timeout)
        while True:
            frames = self._recv(sock, deadline, timeout)
            if not frames[-1].startswith(protocol.MAGIC_REP):
                continue  # a late answer to an earlier get_meta_msg
            rep = self._decode_reply(frames, nonce)
            if rep.rid != rid and not (rep.rid == 0 and isinstance(rep, protocol.ErrorRep)):
                # A late reply to an earlier, timed-out request. (rid 0 is never ours: it is
                # the server refusing a frame it could not attribute -- auth, malformed.)
                continue
            if isinstance(rep, protocol.ErrorRep):
                if rep.code == "auth_rejected":
                    raise AuthError(
                        f"{self.address} refused the request: {rep.message}", rep.hint or None
                    )
                if rep.code == "shutting_down":
                    raise PeerShuttingDownError(f"{self.address}: {rep.message}", rep.hint or None)
                raise PeerError(f"{self.address}: {rep.message}", rep.hint or None)
            return rep

    def _reset(self) -> None:
        # A fresh socket per failed attempt: nothing stale is left queued for the next request.
        self.close()

    def _decode_reply(self, frames: list[bytes], nonce: bytes) -> protocol.SideReply:
        payload = frames[-1]
        env = protocol.decode_envelope(payload, protocol.MAGIC_REP, self._max, "side-channel reply")
        try:
            body = self._auth.open(CH_REPLY + nonce, env)
        except AuthError:
            # Errors for unauthenticated requests are sealed without our nonce.
            body = self._auth.open(CH_REPLY, env)
        return protocol.decode_reply_body(body)
