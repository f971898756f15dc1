"""The ZMQ side channel: a ROUTER server thread per endpoint, and deadline-bound clients.

Server thread (``SideChannelServer``) owns the ROUTER socket. It size-checks each frame, opens
its envelope (authentication), decodes it into a typed request and hands it to the endpoint's
handler together with a ``reply`` callable that any thread may call later; replies are queued and
the server thread is woken through a pipe, so only the owning thread ever touches the socket. A
malformed, oversized or unauthenticated frame is counted and answered with an ``ErrorRep``; no
input can kill the thread. vLLM's ``get_meta_msg`` request is answered in vLLM's reply form.

Clients (``SideChannelClient``) use a DEALER socket with request ids and a poller: a timed-out
request never wedges the socket (a REQ socket would be), and late replies are discarded by id.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from kvpush import PROTOCOL_VERSION, protocol
from kvpush.auth import CH_REPLY, CH_REQUEST, Authenticator
from kvpush.config import format_address
from kvpush.errors import (
    AuthError,
    BindError,
    ConfigError,
    IncompatiblePeerError,
    KvpushError,
    PeerError,
    PeerUnreachableError,
    ProtocolError,
    WrongWireError,
)
from kvpush.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

ReplyFn = Callable[[protocol.SideReply], None]
Handler = Callable[[protocol.SideRequest, ReplyFn], None]
VllmHandler = Callable[[int, int], list[bytes]]
RejectFn = Callable[[str], None]

_ctx_lock = threading.Lock()


def context() -> zmq.Context[zmq.Socket[bytes]]:
    with _ctx_lock:
        return zmq.Context.instance()


class SideChannelServer:
    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        auth: Authenticator,
        *,
        max_frame_bytes: int = protocol.MAX_FRAME_BYTES,
        vllm_handler: VllmHandler | None = None,
        on_reject: RejectFn | None = None,
        name: str = "sidechannel",
    ) -> None:
        self.host = host
        self.port = port
        self._handler = handler
        self._auth = auth
        self._max = max_frame_bytes
        self._vllm = vllm_handler
        self._on_reject = on_reject or (lambda kind: None)
        self._replies: deque[list[bytes]] = deque()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._rl = RateLimitedLog(log)
        self.requests = 0  # kvpush-framed (or unreadable) requests
        self.identifies = 0  # get_meta_msg first contacts
        self.rejected = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 5.0) -> None:
        """Return once the socket is bound, or raise the bind error."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise KvpushError("side channel did not start in time")
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        for fd in (self._rfd, self._wfd):
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def _wake(self) -> None:
        # pipe full (already woken) or closed at shutdown: nothing to do
        with contextlib.suppress(OSError):
            os.write(self._wfd, b"x")

    # ------------------------------------------------------------------ thread body
    def _bind(self) -> zmq.Socket[bytes]:
        sock = context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Hard bound on what ZMQ buffers per message; larger ones drop the connection. Frames
        # between the soft limit (self._max) and this are read, counted and refused.
        sock.setsockopt(zmq.MAXMSGSIZE, self._max * 2 + 4096)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        host = f"[{self.host}]" if ":" in self.host else self.host
        try:
            if self.port == 0:
                sock.bind(f"tcp://{host}:*")
                ep = sock.getsockopt(zmq.LAST_ENDPOINT)
                assert isinstance(ep, bytes)
                self.port = int(ep.decode().rsplit(":", 1)[1])
            else:
                sock.bind(f"tcp://{host}:{self.port}")
        except zmq.ZMQError as e:
            sock.close(0)
            if e.errno == errno.EADDRINUSE:
                raise BindError(
                    f"cannot bind side channel {self.address}: address already in use"
                ) from None
            if e.errno in (errno.EADDRNOTAVAIL, errno.EINVAL, errno.ENODEV):
                raise ConfigError(
                    f"cannot bind side channel {self.address}: {e.strerror}",
                    "use an address of this host, e.g. --host 127.0.0.1",
                ) from None
            raise BindError(f"cannot bind side channel {self.address}: {e.strerror}") from None
        return sock

    def _run(self) -> None:
        try:
            sock = self._bind()
        except BaseException as e:
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._rfd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if self._rfd in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._rfd, 4096)
                if sock in events:
                    for _ in range(64):  # bounded burst, then send replies
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                while self._replies:
                    out = self._replies.popleft()
                    try:
                        sock.send_multipart(out, zmq.NOBLOCK)
                    except zmq.ZMQError as e:  # peer gone or HWM: the reply is dropped
                        self._rl.warning("send", "side channel: reply dropped: %s", e)
        except BaseException as e:  # pragma: no cover - surfaced to the endpoint
            self.failure = e
            log.exception("side channel thread failed")
        finally:
            sock.close(0)

    def _reject(self, ident: bytes, kind: str, message: str, hint: str = "", rid: int = 0) -> None:
        self.rejected += 1
        self._on_reject(kind)
        self._rl.warning(kind, "side channel: rejected a request (%s): %s", kind, message)
        rep = protocol.ErrorRep(rid=rid, code=kind, message=message, hint=hint)
        self._queue_reply(ident, rep, nonce=b"")

    def _queue_reply(self, ident: bytes, rep: protocol.SideReply, nonce: bytes) -> None:
        body = protocol.encode(rep)
        env = self._auth.seal(CH_REPLY + nonce, body)
        self._replies.append([ident, b"", protocol.MAGIC_REP + env])
        if threading.current_thread() is not self._thread:
            self._wake()

    def _answer_get_meta(self, pp_rank: int, tp_rank: int) -> list[bytes]:
        if self._vllm is not None:
            try:
                return self._vllm(pp_rank, tp_rank)
            except Exception as e:  # a handler bug must not kill the side channel
                log.exception("side channel: answering get_meta_msg failed")
                self._on_reject("internal_error")
                error = f"cannot serve rank ({pp_rank}, {tp_rank}): {e}"
        else:
            error = "no metadata to serve"
        # Still vLLM's form (a vLLM client asserts two parts), with no metadata at all.
        ident = protocol.KvpushIdentity(
            protocol=PROTOCOL_VERSION, auth=self._auth.enabled, error=error[:1000]
        )
        return protocol.encode_get_meta_reply(
            protocol.VllmHandshakePayload("", b"", ident), time.perf_counter()
        )

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) <= self._max:
            pp_tp = protocol.is_vllm_get_meta(frames[2])
            if pp_tp is not None:
                # vLLM's request form, and every client's first contact: always answered in
                # vLLM's two-part form, whatever the token (the handler decides what to tell).
                self.identifies += 1
                self._replies.append([frames[0], b"", *self._answer_get_meta(*pp_tp)])
                return
        self.requests += 1
        if len(frames) < 2 or len(frames) > 3:
            if frames:
                self._reject(
                    frames[0], "malformed_frame", f"expected 2-3 frames, got {len(frames)}"
                )
            return
        ident, payload = frames[0], frames[-1]
        if len(frames) == 3 and frames[1] != b"":
            self._reject(ident, "malformed_frame", "missing empty delimiter frame")
            return
        if len(payload) > self._max:
            self._reject(
                ident,
                "oversized_frame",
                f"frame of {len(payload)} bytes exceeds the {self._max}-byte limit",
            )
            return
        if not payload.startswith(protocol.MAGIC_REQ):
            self._reject(ident, "malformed_frame", "not a kvpush request (bad magic)")
            return
        try:
            env = protocol.decode_envelope(
                payload, protocol.MAGIC_REQ, self._max, "side-channel request"
            )
        except ProtocolError as e:
            self._reject(ident, "malformed_frame", str(e))
            return
        try:
            body = self._auth.open(CH_REQUEST, env)
        except AuthError as e:
            self._reject(ident, "auth_rejected", str(e), e.hint)
            return
        try:
            req = protocol.decode_request_body(body)
        except ProtocolError as e:
            self._reject(ident, "malformed_frame", str(e))
            return
        nonce = env.nonce
        done = threading.Event()

        def reply(rep: protocol.SideReply) -> None:
            if done.is_set():
                return
            done.set()
            self._queue_reply(ident, rep, nonce)

        try:
            self._handler(req, reply)
        except KvpushError as e:
            reply(
                protocol.ErrorRep(
                    rid=req.rid, code=type(e).__name__, message=e.message, hint=e.hint
                )
            )
        except Exception as e:  # a handler bug must not kill the side channel
            log.exception("side channel handler failed for %s", type(req).__name__)
            self._on_reject("internal_error")
            reply(protocol.ErrorRep(rid=req.rid, code="internal_error", message=str(e)))


@dataclass(frozen=True)
class PeerIdentity:
    """Who answered a first contact (``get_meta_msg`` for one rank), and when.

    ``kind`` is ``kvpush`` when the answer carries kvpush's identity map, else ``vllm``. Times
    are this process's ``perf_counter``; ``remote_clock`` is the peer's (vLLM: perf_counter,
    meaningful on the same host only).
    """

    address: str
    ranks: tuple[int, int]
    payload: protocol.VllmHandshakePayload
    remote_clock: float
    t_send: float
    t_recv: float

    @property
    def kind(self) -> str:
        return "kvpush" if self.payload.kvpush is not None else "vllm"

    @property
    def kvpush(self) -> protocol.KvpushIdentity | None:
        return self.payload.kvpush

    @property
    def rtt_s(self) -> float:
        return self.t_recv - self.t_send


NOT_A_SIDE_CHANNEL_HINT = "check the address: it must be a kvpush or vLLM NIXL side channel"


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
                    raise PeerUnreachableError(
                        f"{self.address} did not accept a connection within {timeout:g}s"
                    ) from None
                sock.poll(int(min(left, 0.05) * 1000) + 1, zmq.POLLOUT)

    def _recv(self, sock: zmq.Socket[bytes], deadline: float, timeout: float) -> list[bytes]:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            self._reset()
            raise PeerUnreachableError(f"{self.address} did not answer within {timeout:g}s")
        return sock.recv_multipart()

    # ------------------------------------------------------------------ first contact
    def identify(
        self, pp_rank: int = 0, tp_rank: int = 0, timeout_s: float | None = None
    ) -> PeerIdentity:
        """Send vLLM's ``get_meta_msg`` for one rank and read who answered.

        Raises ``PeerUnreachableError`` on timeout and ``ProtocolError`` when the answer is in
        neither kvpush's nor vLLM's form. Sets ``identity`` for the connection.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        sock = self._send(protocol.vllm_get_meta_request(pp_rank, tp_rank), deadline, timeout)
        t0 = time.perf_counter()
        while True:
            frames = self._recv(sock, deadline, timeout)
            t1 = time.perf_counter()
            if frames and frames[-1].startswith(protocol.MAGIC_REP):
                continue  # a late kvpush reply to an earlier request on this connection
            try:
                payload, clock = protocol.decode_get_meta_reply(frames)
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

        Raises ``PeerUnreachableError`` on timeout, ``WrongWireError`` for a vLLM peer,
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
