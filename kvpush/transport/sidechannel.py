"""The ZMQ side-channel server: one ROUTER thread per endpoint (clients: ``transport.client``).

Server thread (``SideChannelServer``) owns the ROUTER socket. It size-checks each frame, opens
its envelope (authentication), decodes it into a typed request and hands it to the endpoint's
handler together with a ``reply`` callable that any thread may call later; replies are queued and
the server thread is woken through a pipe, so only the owning thread ever touches the socket. A
malformed, oversized or unauthenticated frame is counted and answered with an ``ErrorRep``; no
input can kill the thread. vLLM's ``get_meta_msg`` request is answered in vLLM's reply form.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from kvpush import PROTOCOL_VERSION
from kvpush.address import format_address
from kvpush.errors import (
    AuthError,
    BadValueError,
    BindError,
    ConfigError,
    KvpushError,
    ProtocolError,
)
from kvpush.ratelog import RateLimitedLog
from kvpush.telemetry.heartbeat import Heartbeat
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import CH_REPLY, CH_REQUEST, Authenticator

log = logging.getLogger(__name__)

BAD_VALUE_HINT = "every time is seconds in [0, 3600] (a deadline: [0, 86400]); numbers are finite"

ReplyFn = Callable[[protocol.SideReply], None]
Handler = Callable[[protocol.SideRequest, ReplyFn], None]
# Answers vLLM's ``get_meta_msg`` for (pp, tp): every client's first contact, on either wire.
GetMetaHandler = Callable[[int, int], list[bytes]]
RejectFn = Callable[[Failure], None]

_ctx_lock = threading.Lock()
#: A stopped side channel stays open until no answer went out for CLOSE_GRACE_S, at most
#: CLOSE_GRACE_MAX_S: its clients read the last answers before their connection breaks (their
#: DEALER is ZMQ_IMMEDIATE, and libzmq throws away what a broken connection holds unread).
CLOSE_GRACE_S = 0.25
CLOSE_GRACE_MAX_S = 1.0
#: How long ZMQ may go on sending a closed side channel's last answers (seconds).
CLOSE_LINGER_S = 1.0


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
        get_meta: GetMetaHandler | None = None,
        on_reject: RejectFn | None = None,
        name: str = "sidechannel",
    ) -> None:
        self.host = host
        self.port = port
        self._handler = handler
        self._auth = auth
        self._max = max_frame_bytes
        self._get_meta = get_meta
        self._on_reject = on_reject or (lambda kind: None)
        self._replies: deque[list[bytes]] = deque()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._stop = threading.Event()
        self._stop_t = 0.0  # when stop() was called
        self._last_sent = float("-inf")  # when an answer last went out
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Progress for the freeze watchdog (kvpush.runtime.watchdog): bumped on every pass.
        self.heartbeat = Heartbeat(name)
        self._rl = RateLimitedLog(log)
        self.requests = 0  # kvpush-framed (or unreadable) requests
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
        self._stop_t = time.monotonic()
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
        self.heartbeat.start()
        try:
            while not self._done():
                self.heartbeat.beat()
                events = dict(poller.poll(50 if self._stop.is_set() else 200))
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
                self._send_replies(sock)
        except BaseException as e:  # pragma: no cover - surfaced to the endpoint
            self.failure = e
            log.exception("side channel thread failed")
        finally:
            self.heartbeat.park()
            # What is still queued goes out: ZMQ gets up to CLOSE_LINGER_S to put it on the
            # wire after the socket closes.
            self._send_replies(sock)
            sock.setsockopt(zmq.LINGER, int(CLOSE_LINGER_S * 1000))
            sock.close()

    def _done(self) -> bool:
        """Stopped, and its clients had time to read the last answers (``CLOSE_GRACE_S``)."""
        if not self._stop.is_set():
            return False
        now = time.monotonic()
        return now - self._last_sent >= CLOSE_GRACE_S or now - self._stop_t >= CLOSE_GRACE_MAX_S

    def _send_replies(self, sock: zmq.Socket[bytes]) -> None:
        while self._replies:
            out = self._replies.popleft()
            self._last_sent = time.monotonic()
            try:
                sock.send_multipart(out, zmq.NOBLOCK)
            except zmq.ZMQError as e:  # peer gone or HWM: the reply is dropped
                self._rl.warning("send", "side channel: reply dropped: %s", e)

    def _reject(
        self, ident: bytes, kind: Failure, message: str, hint: str = "", rid: int = 0
    ) -> None:
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
        if self._get_meta is not None:
            try:
                return self._get_meta(pp_rank, tp_rank)
            except Exception as e:  # a handler bug must not kill the side channel
                log.exception("side channel: answering get_meta_msg failed")
                self._on_reject(Failure.INTERNAL_ERROR)
                error = f"cannot serve rank ({pp_rank}, {tp_rank}): {e}"
        else:
            error = "no metadata to serve"
        # Still vLLM's form (a vLLM client asserts two parts), with no metadata at all.
        ident = vllm.KvpushIdentity(
            protocol=PROTOCOL_VERSION, auth=self._auth.enabled, error=error[:1000]
        )
        return vllm.encode_get_meta_reply(
            vllm.HandshakePayload("", b"", ident), time.perf_counter()
        )

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) <= self._max:
            pp_tp = vllm.is_get_meta(frames[2])
            if pp_tp is not None:
                # vLLM's request form, and every client's first contact: always answered in
                # vLLM's two-part form, whatever the token (the handler decides what to tell).
                self._replies.append([frames[0], b"", *self._answer_get_meta(*pp_tp)])
                return
        self.requests += 1
        payload = self._payload(frames)
        if payload is None:
            return  # rejected (or nobody to answer)
        ident = frames[0]
        opened = self._open(ident, payload)
        if opened is not None:
            self._serve(ident, *opened)

    def _payload(self, frames: list[bytes]) -> bytes | None:
        """A request's payload frame once its framing and size are right; else None (the
        request was rejected, when there is anyone to answer)."""
        if len(frames) < 2 or len(frames) > 3:
            if frames:
                self._reject(
                    frames[0], Failure.MALFORMED_FRAME, f"expected 2-3 frames, got {len(frames)}"
                )
            return None
        ident, payload = frames[0], frames[-1]
        if len(frames) == 3 and frames[1] != b"":
            self._reject(ident, Failure.MALFORMED_FRAME, "missing empty delimiter frame")
            return None
        if len(payload) > self._max:
            self._reject(
                ident,
                Failure.OVERSIZED_FRAME,
                f"frame of {len(payload)} bytes exceeds the {self._max}-byte limit",
            )
            return None
        if not payload.startswith(protocol.MAGIC_REQ):
            self._reject(ident, Failure.MALFORMED_FRAME, "not a kvpush request (bad magic)")
            return None
        return payload

    def _open(self, ident: bytes, payload: bytes) -> tuple[protocol.SideRequest, bytes] | None:
        """The typed request in ``payload`` and its envelope's nonce, once its envelope opened
        (authentication) and its body decoded; else None (the request was rejected)."""
        try:
            env = protocol.decode_envelope(
                payload, protocol.MAGIC_REQ, self._max, "side-channel request"
            )
        except ProtocolError as e:
            self._reject(ident, Failure.MALFORMED_FRAME, str(e))
            return None
        try:
            body = self._auth.open(CH_REQUEST, env)
        except AuthError as e:
            self._reject(ident, Failure.AUTH_REJECTED, str(e), e.hint)
            return None
        try:
            req = protocol.decode_request_body(body)
        except BadValueError as e:
            self._reject(ident, Failure.BAD_VALUE, str(e), BAD_VALUE_HINT)
            return None
        except ProtocolError as e:
            self._reject(ident, Failure.MALFORMED_FRAME, str(e))
            return None
        return req, env.nonce

    def _serve(self, ident: bytes, req: protocol.SideRequest, nonce: bytes) -> None:
        """Hand ``req`` to the handler with a ``reply`` that answers it once, from any thread."""
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
            self._on_reject(Failure.INTERNAL_ERROR)
            reply(protocol.ErrorRep(rid=req.rid, code=Failure.INTERNAL_ERROR, message=str(e)))
