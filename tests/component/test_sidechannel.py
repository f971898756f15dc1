"""The ZMQ side channel over real sockets on 127.0.0.1: server robustness, client deadlines."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from kvpush.errors import (
    AuthError,
    BindError,
    ConfigError,
    KvpushError,
    PeerError,
    PeerUnreachableError,
    WrongWireError,
)
from kvpush.transport.client import SideChannelClient
from kvpush.transport.sidechannel import ReplyFn, SideChannelServer, context
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import CH_REPLY, CH_REQUEST, Authenticator
from tests.support.fakes import closed_port

TOKEN = b"side-channel-token-0123456789"


class Server:
    """A SideChannelServer with a scriptable handler and a record of rejections."""

    def __init__(self, token: bytes | None = None, max_frame_bytes: int = 64 * 1024) -> None:
        self.rejects: list[str] = []
        self.held: list[tuple[protocol.SideRequest, ReplyFn]] = []
        self.hold = False
        self.raise_: BaseException | None = None
        # What a kvpush endpoint answers to get_meta_msg: vLLM's form + kvpush's identity.
        self.vllm: Callable[[int, int], list[bytes]] | None = lambda pp, tp: [
            msgspec.msgpack.encode(
                vllm.HandshakePayload(
                    compatibility_hash="h",
                    agent_metadata_bytes=b"md-%d-%d" % (pp, tp),
                    kvpush=vllm.KvpushIdentity(
                        protocol=protocol.PROTOCOL_VERSION, auth=token is not None
                    ),
                )
            ),
            msgspec.msgpack.encode(123.25),
        ]
        self.srv = SideChannelServer(
            "127.0.0.1",
            0,
            self.handle,
            Authenticator(token),
            max_frame_bytes=max_frame_bytes,
            get_meta=lambda pp, tp: self.vllm(pp, tp) if self.vllm else [],
            on_reject=self.rejects.append,
        )
        self.srv.start()

    @property
    def port(self) -> int:
        return self.srv.port

    def handle(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        if self.raise_ is not None:
            raise self.raise_
        if self.hold:
            self.held.append((req, reply))
            return
        reply(protocol.StatsRep(rid=req.rid, snapshot={"echo": type(req).__name__}))

    def client(self, auth: Authenticator | None = None) -> SideChannelClient:
        return SideChannelClient("127.0.0.1", self.port, auth=auth)


@pytest.fixture
def make_server() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(token: bytes | None = None, max_frame_bytes: int = 64 * 1024) -> Server:
        s = Server(token, max_frame_bytes)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.srv.stop()
        assert s.srv.failure is None


@pytest.fixture
def server(make_server: Callable[..., Server]) -> Server:
    return make_server()


class Raw:
    """A raw DEALER: sends arbitrary frames, reads raw replies."""

    def __init__(self, port: int) -> None:
        self.sock = context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, *frames: bytes, timeout_s: float = 5.0) -> list[bytes] | None:
        self.sock.send_multipart(list(frames))
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        return self.sock.recv_multipart()

    def error(self, *frames: bytes) -> protocol.ErrorRep:
        got = self.ask(*frames)
        assert got is not None, "no reply"
        assert got[0] == b""
        env = protocol.decode_envelope(got[-1], protocol.MAGIC_REP, 1 << 20, "reply")
        rep = protocol.decode_reply_body(Authenticator(None).open(CH_REPLY, env))
        assert isinstance(rep, protocol.ErrorRep)
        return rep

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def raw(server: Server) -> Iterator[Raw]:
    r = Raw(server.port)
    yield r
    r.close()


def _still_serves(server: Server) -> None:
    with server.client() as c:
        rep = c.request(protocol.StatsReq(), timeout_s=5)
    assert isinstance(rep, protocol.StatsRep) and rep.snapshot == {"echo": "StatsReq"}


def _request_frame(req: protocol.SideRequest, auth: Authenticator | None = None) -> bytes:
    a = auth or Authenticator(None)
    return protocol.MAGIC_REQ + a.seal(CH_REQUEST, protocol.encode(req))


# ------------------------------------------------------------------ request / reply


def test_request_reply(server: Server) -> None:
    with server.client() as c:
        for _ in range(3):
            rep = c.request(protocol.PingReq(), timeout_s=5)
            assert isinstance(rep, protocol.StatsRep) and rep.snapshot == {"echo": "PingReq"}
    assert server.srv.requests == 3 and server.srv.rejected == 0


def test_reply_from_another_thread_later(server: Server) -> None:
    server.hold = True
    result: list[protocol.SideReply] = []
    with server.client() as c:
        t = threading.Thread(target=lambda: result.append(c.request(protocol.StatsReq())))
        t.start()
        while not server.held:
            t.join(0.001)
        req, reply = server.held.pop()
        threading.Thread(
            target=reply, args=(protocol.StatsRep(rid=req.rid, snapshot={"late": 1}),)
        ).start()
        t.join(10)
    assert isinstance(result[0], protocol.StatsRep) and result[0].snapshot == {"late": 1}


@pytest.mark.parametrize("size", [1, 4 << 20], ids=["small", "4MiB"])
def test_answers_given_just_before_stop_still_reach_their_clients(
    make_server: Callable[..., Server], size: int
) -> None:
    """What an endpoint's drain ends is answered, then the side channel stops at once: each
    answer given before ``stop`` reaches its client. Small ones: the clients read them before
    their connection breaks (their DEALER drops what a broken connection holds unread); large
    ones (a big endpoint's stats): ZMQ is still sending when the socket closes."""
    big: dict[str, object] = {"last": "x" * size}
    server = make_server()
    server.hold = True
    n = 16
    clients = [server.client() for _ in range(n)]
    result: list[protocol.SideReply | BaseException] = []

    def ask(c: SideChannelClient) -> None:
        try:
            result.append(c.request(protocol.StatsReq(), timeout_s=5))
        except BaseException as e:
            result.append(e)

    threads = [threading.Thread(target=ask, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    while len(server.held) < n:
        threads[0].join(0.001)
    for req, reply in server.held:
        reply(protocol.StatsRep(rid=req.rid, snapshot=big))
    server.srv.stop()
    for t in threads:
        t.join(10)
    for c in clients:
        c.close()
    assert len(result) == n
    missed = [r for r in result if not isinstance(r, protocol.StatsRep) or r.snapshot != big]
    assert not missed, missed


def test_handler_errors_become_error_replies(server: Server) -> None:
    server.raise_ = KvpushError("no such transfer", "check the id")
    with server.client() as c, pytest.raises(PeerError) as ei:
        c.request(protocol.StatsReq(), timeout_s=5)
    assert str(ei.value) == f"127.0.0.1:{server.port}: no such transfer"
    assert ei.value.hint == "check the id"
    server.raise_ = RuntimeError("handler bug")
    with server.client() as c, pytest.raises(PeerError, match="handler bug"):
        c.request(protocol.StatsReq(), timeout_s=5)
    assert server.rejects == ["internal_error"]
    server.raise_ = None
    _still_serves(server)


# ------------------------------------------------------------------ malformed input


@pytest.mark.parametrize(
    ("frames", "code", "message"),
    [
        ([b"", b"garbage"], "malformed_frame", "not a kvpush request (bad magic)"),
        ([b"", b"a", b"b", b"c"], "malformed_frame", "expected 2-3 frames, got 5"),
        ([b"x", _request_frame(protocol.StatsReq())], "malformed_frame", "missing empty delimiter"),
        ([b"", protocol.MAGIC_REQ + b"\xff"], "malformed_frame", "malformed side-channel request"),
        (
            [b"", protocol.MAGIC_REQ + protocol.make_envelope_bytes(b"\x91" * 30_000)],
            "malformed_frame",
            "malformed side-channel request",
        ),
        (
            [b"", protocol.MAGIC_REQ + protocol.make_envelope_bytes(b"{}")],
            "malformed_frame",
            "malformed side-channel request",
        ),
        ([b"", b"\x00" * (64 * 1024 + 1)], "oversized_frame", "frame of 65537 bytes exceeds"),
    ],
    ids=["bad_magic", "frame_count", "delimiter", "envelope", "deep", "body", "oversized"],
)
def test_malformed_frames_counted_answered_and_server_survives(
    server: Server, raw: Raw, frames: list[bytes], code: str, message: str
) -> None:
    rep = raw.error(*frames)
    assert rep.code == code and message in rep.message
    assert server.rejects == [code]
    _still_serves(server)


def test_frame_over_the_hard_limit_drops_that_connection_only(server: Server, raw: Raw) -> None:
    # ZMQ's MAXMSGSIZE (about twice the soft limit) disconnects the sender; nothing is read.
    assert raw.ask(b"", b"\x00" * (200 * 1024), timeout_s=0.3) is None
    _still_serves(server)


def test_random_frames(server: Server, raw: Raw) -> None:
    rng = random.Random(1234)
    for i in range(60):
        payload = rng.randbytes(rng.randrange(0, 300))
        if i % 3 == 0:
            payload = protocol.MAGIC_REQ + payload
        rep = raw.error(b"", payload)
        assert rep.code == "malformed_frame"
    assert server.srv.rejected == 60
    _still_serves(server)


def test_authentication(make_server: Callable[..., Server]) -> None:
    server = make_server(token=TOKEN)
    with server.client(auth=Authenticator(TOKEN)) as c:
        assert isinstance(c.request(protocol.StatsReq(), timeout_s=5), protocol.StatsRep)
    with server.client() as c, pytest.raises(AuthError) as ei:
        c.request(protocol.StatsReq(), timeout_s=5)
    # Told at first contact, before any kvpush frame is sent.
    assert str(ei.value) == (
        f"127.0.0.1:{server.port} is a kvpush endpoint that requires an auth token"
    )
    with server.client(auth=Authenticator(b"x" * 32)) as c, pytest.raises(AuthError):
        c.request(protocol.StatsReq(), timeout_s=5)
    # The client without a token never sent a kvpush frame: one rejection, the wrong token.
    assert server.rejects == ["auth_rejected"]
    # A replayed (captured) request is refused too.
    raw = Raw(server.port)
    try:
        frame = _request_frame(protocol.StatsReq(rid=7), Authenticator(TOKEN))
        assert raw.ask(b"", frame) is not None
        rep_frames = raw.ask(b"", frame)
        assert rep_frames is not None
        env = protocol.decode_envelope(rep_frames[-1], protocol.MAGIC_REP, 1 << 20, "r")
        rep = protocol.decode_reply_body(Authenticator(TOKEN).open(CH_REPLY, env))
        assert isinstance(rep, protocol.ErrorRep) and rep.code == "auth_rejected"
        assert "replayed" in rep.message
    finally:
        raw.close()


# ------------------------------------------------------------------ client deadlines


def test_client_timeout_then_reuse(server: Server) -> None:
    server.hold = True
    c = server.client()
    try:
        with pytest.raises(PeerUnreachableError) as ei:
            c.request(protocol.StatsReq(), timeout_s=0.3)
        assert str(ei.value) == f"127.0.0.1:{server.port} did not answer within 0.3s"
        assert ei.value.exit_status == 69
        ((old_req, late_reply),) = server.held
        server.held.clear()
        server.hold = False
        late_reply(protocol.StatsRep(rid=old_req.rid, snapshot={"late": True}))
        rep = c.request(protocol.StatsReq(), timeout_s=5)  # same client, works again
        assert isinstance(rep, protocol.StatsRep) and rep.snapshot == {"echo": "StatsReq"}
        assert rep.rid != old_req.rid
    finally:
        c.close()


def test_unreachable_address() -> None:
    # A closed port is told at once (issue 17), not after the whole timeout.
    port = closed_port()
    with SideChannelClient("127.0.0.1", port) as c, pytest.raises(PeerUnreachableError) as ei:
        c.request(protocol.StatsReq(), timeout_s=5)
    assert str(ei.value) == f"127.0.0.1:{port}: connection refused"
    assert f"nothing listens on port {port}" in ei.value.hint


def test_a_port_that_never_connects_waits_out_the_timeout() -> None:
    # A deadline shorter than the moment the client looks at the port over TCP ends with
    # the plain timeout message.
    port = closed_port()
    with SideChannelClient("127.0.0.1", port) as c, pytest.raises(PeerUnreachableError) as ei:
        c.request(protocol.StatsReq(), timeout_s=0.05)  # over before the TCP look
    assert str(ei.value) == f"127.0.0.1:{port} did not accept a connection within 0.05s"


def test_late_replies_discarded_by_request_id() -> None:
    """A peer that first sends a stale reply (an earlier request's id) then the real one."""
    router = context().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    ep = router.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(ep, bytes)
    port = int(ep.decode().rsplit(":", 1)[1])
    auth = Authenticator(None)
    done = threading.Event()

    def serve() -> None:
        ident, _, payload = router.recv_multipart()  # first contact: get_meta_msg
        assert vllm.is_get_meta(payload) == (0, 0)
        kv = vllm.KvpushIdentity(protocol=protocol.PROTOCOL_VERSION)
        router.send_multipart(
            [
                ident,
                b"",
                *vllm.encode_get_meta_reply(vllm.HandshakePayload("", b"", kv), 0.0),
            ]
        )
        ident, _, payload = router.recv_multipart()
        env = protocol.decode_envelope(payload, protocol.MAGIC_REQ, 1 << 20, "req")
        req = protocol.decode_request_body(env.body)
        for rid, tag in ((req.rid + 1000, "stale"), (req.rid, "fresh")):
            body = protocol.encode(protocol.StatsRep(rid=rid, snapshot={"which": tag}))
            router.send_multipart(
                [ident, b"", protocol.MAGIC_REP + auth.seal(CH_REPLY + env.nonce, body)]
            )
        done.wait(10)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with SideChannelClient("127.0.0.1", port) as c:
            rep = c.request(protocol.StatsReq(), timeout_s=5)
        assert isinstance(rep, protocol.StatsRep) and rep.snapshot == {"which": "fresh"}
    finally:
        done.set()
        t.join(10)
        router.close(0)


# ------------------------------------------------------------------ vLLM form


def vllm_get_meta(
    port: int, pp_rank: int = 0, tp_rank: int = 0, timeout_s: float = 5.0
) -> list[bytes]:
    """What vLLM's own client does: a fresh REQ socket, one get_meta_msg, two parts back."""
    s = context().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(vllm.get_meta_request(pp_rank, tp_rank))
        assert s.poll(int(timeout_s * 1000), zmq.POLLIN), "no answer to get_meta_msg"
        return s.recv_multipart()
    finally:
        s.close(0)


def test_vllm_get_meta_two_part_reply(server: Server) -> None:
    frames = vllm_get_meta(server.port, pp_rank=1, tp_rank=2)
    assert len(frames) == 2
    payload = vllm.decode_payload(frames[0])
    assert payload.agent_metadata_bytes == b"md-1-2"
    assert payload.kvpush is not None and payload.kvpush.protocol == protocol.PROTOCOL_VERSION
    assert msgspec.msgpack.decode(frames[1]) == 123.25


def test_vllm_handler_error_answered_in_vllm_form(server: Server) -> None:
    def boom(pp: int, tp: int) -> list[bytes]:
        raise RuntimeError("no metadata yet")

    server.vllm = boom
    frames = vllm_get_meta(server.port)
    assert len(frames) == 2  # a vLLM client asserts two parts
    payload, _clock = vllm.decode_get_meta_reply(frames)
    assert payload.agent_metadata_bytes == b"" and payload.compatibility_hash == ""
    assert payload.kvpush is not None
    assert payload.kvpush.error == "cannot serve rank (0, 0): no metadata yet"
    assert server.rejects == ["internal_error"]
    _still_serves(server)


def test_get_meta_answered_when_a_token_is_set(make_server: Callable[..., Server]) -> None:
    server = make_server(token=TOKEN)
    frames = vllm_get_meta(server.port)
    payload, _clock = vllm.decode_get_meta_reply(frames)
    assert payload.kvpush is not None and payload.kvpush.auth is True


def test_client_identifies_before_its_first_request(server: Server) -> None:
    """The first frame any client sends is get_meta_msg; kvpush framing only after it."""
    seen: list[bytes] = []
    inner = server.vllm
    assert inner is not None

    def spy(pp: int, tp: int) -> list[bytes]:
        seen.append(b"get_meta_msg")
        return inner(pp, tp)

    server.vllm = spy
    with server.client() as c:
        assert c.identity is None
        rep = c.request(protocol.StatsReq(), timeout_s=5)
        assert isinstance(rep, protocol.StatsRep)
        assert c.identity is not None and c.identity.kind == "kvpush"
        c.request(protocol.StatsReq(), timeout_s=5)
    assert seen == [b"get_meta_msg"]  # once per connection


def test_client_refuses_a_vllm_peer(server: Server) -> None:
    server.vllm = lambda pp, tp: [
        msgspec.msgpack.encode(vllm.HandshakePayload("vllm-hash", b"md")),
        msgspec.msgpack.encode(1.0),
    ]
    with server.client() as c, pytest.raises(WrongWireError) as ei:
        c.request(protocol.StatsReq(), timeout_s=5)
    assert ei.value.message.startswith(
        f"127.0.0.1:{server.port} is a vLLM NIXL side channel, not a kvpush endpoint"
    )
    assert "--wire vllm" in ei.value.hint
    assert server.held == [] and server.rejects == []  # it got nothing but get_meta_msg


def test_client_without_token_told_a_token_is_needed(make_server: Callable[..., Server]) -> None:
    server = make_server(token=TOKEN)
    with server.client() as c, pytest.raises(AuthError) as ei:
        c.request(protocol.StatsReq(), timeout_s=5)
    assert str(ei.value) == (
        f"127.0.0.1:{server.port} is a kvpush endpoint that requires an auth token"
    )


# ------------------------------------------------------------------ binding


def test_port_in_use(server: Server) -> None:
    other = SideChannelServer("127.0.0.1", server.port, server.handle, Authenticator(None))
    with pytest.raises(BindError) as ei:
        other.start()
    assert str(ei.value) == (
        f"cannot bind side channel 127.0.0.1:{server.port}: address already in use"
    )
    other.stop()


def test_address_not_on_this_host() -> None:
    srv = SideChannelServer("192.0.2.1", 0, lambda r, f: None, Authenticator(None))
    with pytest.raises(ConfigError) as ei:
        srv.start()
    assert str(ei.value).startswith("cannot bind side channel 192.0.2.1:0: ")
    assert ei.value.hint == "use an address of this host, e.g. --host 127.0.0.1"
    srv.stop()
