"""The one seam component tests fake: the NIXL agent. Plus real-socket peer stubs.

``FakeAgent`` implements ``kvpush.transport.agent.Agent``, the protocol the writer, the decode
receiver and the handshake manager are typed against (``NixlAgent`` is the real one). It records
every call, keeps the notifications sent and the WRITEs posted, and lets a test script what NIXL
answers: the first state of a WRITE, the state of each posted WRITE, and
``TransferError(kind, msg)`` exceptions from any method. It is thread-safe (handshake threads
load agents while the owner thread posts).

Fake "agent metadata" is ``b"FAKE-FULL:" + name`` (full) or ``b"FAKE-CONN:" + name``
(connection-only); ``add_remote`` accepts only those, so a test can tell which kind a handshake
loaded.

``StubPeer`` is *not* a fake of kvpush code: it is a real ``SideChannelServer`` on 127.0.0.1
answering ``HandshakeReq`` with metadata built the way ``Endpoint`` builds it, with test controls
(hold replies until released, answer with an error, change incarnation). ``BlackHole`` is a ZMQ
ROUTER that accepts connections and never answers. The real ``HandshakeManager`` runs against
them, so no second seam is faked.
"""

from __future__ import annotations

import itertools
import random
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypedDict

import msgspec
import numpy as np
import zmq

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.address import format_address
from kvpush.config import EndpointConfig, PoolConfig, Role
from kvpush.instruments import NO_INSTRUMENTS, Instruments
from kvpush.memory.pool import KvPool
from kvpush.peers.dialect import KvpushDialect
from kvpush.peers.handshakes import HandshakeManager
from kvpush.runtime.context import EndpointContext
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import (
    Agent,
    DList,
    Indices,
    TransferError,
    TransferKind,
    Xfer,
    XferState,
)
from kvpush.transport.sidechannel import ReplyFn, SideChannelServer, context
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator
from kvpush.wire.notifs import NotifCodec

FULL_PREFIX = b"FAKE-FULL:"
CONN_PREFIX = b"FAKE-CONN:"


def fake_agent_md(name: str, full: bool) -> bytes:
    return (FULL_PREFIX if full else CONN_PREFIX) + name.encode()


def wait_until(pred: Callable[[], object], timeout_s: float = 5.0, what: str = "") -> None:
    """Bounded wait for a condition set by another thread (never a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or pred}")
        time.sleep(0.001)


def closed_port() -> int:
    """A loopback TCP port nobody listens on, below the ephemeral range (so that no client can
    ever self-connect to it). Found with a plain socket: its close is synchronous, unlike ZMQ's."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port found")


# ------------------------------------------------------------------------------ the fake agent


class FakeHandle:
    """Stands in for a NIXL handle (xfer or dlist); remembers whether it was released."""

    _ids = itertools.count(1)

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.id = next(self._ids)
        self.released = False

    def release(self) -> None:
        self.released = True

    def __repr__(self) -> str:
        return f"FakeHandle({self.kind}#{self.id})"


@dataclass
class Write:
    """One posted WRITE as the fake saw it."""

    xfer: Xfer
    local: DList
    local_idx: np.ndarray
    remote: DList
    remote_idx: np.ndarray
    notif: bytes


@dataclass
class Prepped:
    name: str
    descs: np.ndarray
    mem_type: str
    dlist: DList


@dataclass
class FakeAgent:
    """Records calls; answers as scripted. Default: every WRITE is ``PROC`` at post and ``DONE``
    at the first ``state`` call."""

    name: str = "P-fake#0"
    post_state: XferState = XferState.PROC
    default_state: XferState = XferState.DONE
    release_ok: bool = True
    etcd_metadata: bool = False  # --nixl-metadata etcd is a real-NIXL concern (test_fleet_*)
    calls: list[tuple[str, tuple[object, ...]]] = field(default_factory=list)
    loaded: dict[str, str] = field(default_factory=dict)  # remote name -> "full" | "conn"
    removed: list[str] = field(default_factory=list)
    dropped_under: list[str] = field(default_factory=list)
    published: dict[str, bytes] = field(default_factory=dict)  # what fetch_remote finds
    connected: list[str] = field(default_factory=list)
    prepped_remote: list[Prepped] = field(default_factory=list)
    released_dlists: list[DList] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    released_xfers: list[Xfer] = field(default_factory=list)
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    _inbox: dict[str, list[bytes]] = field(default_factory=dict)
    _states: dict[int, deque[XferState | BaseException]] = field(default_factory=dict)
    _raises: dict[str, deque[BaseException]] = field(default_factory=dict)
    _hooks: dict[str, Callable[..., None]] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # -- scripting ------------------------------------------------------------------------
    def raise_on(self, method: str, exc: BaseException, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` raise ``exc``."""
        with self._lock:
            self._raises.setdefault(method, deque()).extend([exc] * times)

    def on_call(self, method: str, hook: Callable[..., None]) -> None:
        """Run ``hook(*args)`` inside the next calls of ``method`` (e.g. to block or raise)."""
        with self._lock:
            self._hooks[method] = hook

    def script_states(self, xfer: Xfer, *states: XferState | BaseException) -> None:
        """What successive ``state(xfer)`` calls return (an exception is raised); then
        ``default_state``."""
        with self._lock:
            self._states.setdefault(id(xfer.handle), deque()).extend(states)

    def deliver(self, sender: str, *msgs: bytes) -> None:
        """Queue notifications for the next ``get_notifs``."""
        with self._lock:
            self._inbox.setdefault(sender, []).extend(msgs)

    def count(self, method: str) -> int:
        with self._lock:
            return sum(1 for m, _ in self.calls if m == method)

    def sent_to(self, name: str) -> list[bytes]:
        with self._lock:
            return [m for n, m in self.sent if n == name]

    def _enter(self, method: str, *args: object) -> None:
        with self._lock:
            self.calls.append((method, args))
            hook = self._hooks.get(method)
            q = self._raises.get(method)
            exc = q.popleft() if q else None
        if hook is not None:
            hook(*args)
        if exc is not None:
            raise exc

    # -- NixlAgent interface ----------------------------------------------------------------
    def metadata_full(self) -> bytes:
        return fake_agent_md(self.name, full=True)

    def metadata_conn_only(self) -> bytes:
        return fake_agent_md(self.name, full=False)

    def add_remote(self, metadata: bytes) -> str:
        self._enter("add_remote", metadata)
        for prefix, kind in ((FULL_PREFIX, "full"), (CONN_PREFIX, "conn")):
            if metadata.startswith(prefix):
                name = metadata[len(prefix) :].decode()
                with self._lock:
                    self.loaded[name] = kind
                return name
        raise TransferError(
            TransferKind.NIXL_ERROR, f"add_remote_agent: unparseable metadata {metadata[:32]!r}"
        )

    def fetch_remote(self, name: str, timeout_s: float) -> str:
        """Load ``name`` from what a test ``published`` (NIXL's etcd backend, faked)."""
        self._enter("fetch_remote", name, timeout_s)
        with self._lock:
            md = self.published.get(name)
        if md is None:
            raise TransferError(TransferKind.PEER_UNKNOWN, f"agent {name} not published")
        return self.add_remote(md)

    def drop_remote_under(self, name: str) -> None:
        """NIXL forgets ``name`` (the fault the real adapter injects); kept in ``dropped_under``."""
        self._enter("drop_remote_under", name)
        with self._lock:
            self.loaded.pop(name, None)
            self.dropped_under.append(name)

    def remove_remote(self, name: str) -> None:
        self._enter("remove_remote", name)
        with self._lock:
            self.loaded.pop(name, None)
            self.removed.append(name)

    def make_connection(self, name: str) -> None:
        self._enter("make_connection", name)
        with self._lock:
            self.connected.append(name)

    def prep_local(self, descs: np.ndarray, mem_type: str) -> DList:
        self._enter("prep_local", descs, mem_type)
        return DList(FakeHandle("local-dlist"), len(descs))

    def prep_remote(self, name: str, descs: np.ndarray, mem_type: str) -> DList:
        self._enter("prep_remote", name, descs, mem_type)
        dl = DList(FakeHandle(f"remote-dlist:{name}"), len(descs))
        with self._lock:
            self.prepped_remote.append(Prepped(name, np.array(descs, copy=True), mem_type, dl))
        return dl

    def release_dlist(self, dl: DList) -> None:
        self._enter("release_dlist", dl)
        dl.handle.release()
        with self._lock:
            self.released_dlists.append(dl)

    def post_write(
        self,
        local: DList,
        local_idx: Indices,
        remote: DList,
        remote_idx: Indices,
        notif: bytes,
    ) -> tuple[Xfer, XferState]:
        self._enter("post_write", local, local_idx, remote, remote_idx, notif)
        x = Xfer(FakeHandle("xfer"))
        with self._lock:
            self.writes.append(
                Write(x, local, np.array(local_idx), remote, np.array(remote_idx), notif)
            )
        return x, self.post_state

    def state(self, x: Xfer) -> XferState:
        self._enter("state", x)
        with self._lock:
            q = self._states.get(id(x.handle))
            st: XferState | BaseException = q.popleft() if q else self.default_state
        if isinstance(st, BaseException):
            raise st
        return st

    def release(self, x: Xfer) -> bool:
        self._enter("release", x)
        if x.released:
            return True
        if not self.release_ok:
            return False
        x.handle.release()
        x.released = True
        with self._lock:
            self.released_xfers.append(x)
        return True

    def send_notif(self, name: str, msg: bytes) -> None:
        self._enter("send_notif", name, msg)
        with self._lock:
            self.sent.append((name, msg))

    def get_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            # not recorded in ``calls``: owner threads poll this continuously
            q = self._raises.get("get_notifs")
            if q:
                raise q.popleft()
            out, self._inbox = self._inbox, {}
        return out

    def close(self) -> None:
        self._enter("close")


# ------------------------------------------------------------------------------ peer stubs


def stub_pool(**kw: Any) -> PoolConfig:
    """A tiny pool geometry shared by P and its stub peers (compatible unless told otherwise)."""
    base: dict[str, Any] = {"num_blocks": 32, "layers": 2, "block_bytes": 64, "dtype": "uint8"}
    base.update(kw)
    return PoolConfig(**base)


def fake_context(
    cfg: EndpointConfig, agent: FakeAgent, instruments: Instruments = NO_INSTRUMENTS
) -> EndpointContext:
    """One rank's ``EndpointContext`` for ``cfg`` over a fake NIXL agent, built like an
    endpoint builds it (real pool, telemetry, handshakes, codec and dialect; no auth token),
    for tests that run a role's thread passes themselves."""
    tm = Telemetry(cfg.role, cfg.engine_id)
    auth = Authenticator(None)
    md = make_metadata(
        cfg.role,
        cfg.pool,
        engine_id=cfg.engine_id,
        incarnation=uuid.uuid4().hex,
        tp_size=cfg.tp_size,
    )
    return EndpointContext(
        cfg=cfg,
        agent=agent,
        pool=KvPool(cfg.pool),
        handshakes=HandshakeManager(agent, md, auth, cfg.timeouts, tm),
        codec=NotifCodec(auth),
        dialect=KvpushDialect(auth),
        telemetry=tm,
        metadata=md,
        on_ping=lambda sender, msg: None,
        control=ThreadPoolExecutor(1),
        instruments=instruments,
    )


def make_metadata(
    role: Role,
    pool: PoolConfig,
    *,
    engine_id: str,
    incarnation: str,
    host: str = "127.0.0.1",
    port: int = 0,
    tp_size: int = 1,
    base_addr: int = 0x7F00_0000_0000,
) -> protocol.EndpointMetadata:
    """Endpoint metadata built like ``Endpoint._start`` builds it (fake region addresses)."""
    stride = pool.num_blocks * pool.block_bytes
    return protocol.EndpointMetadata(
        protocol_version=PROTOCOL_VERSION,
        kvpush_version=__version__,
        engine_id=engine_id,
        role=role,
        incarnation=incarnation,
        agent_name=f"{engine_id}#{incarnation[:12]}",
        host=host,
        port=port,
        tp_rank=0,
        tp_size=tp_size,
        device_kind="DRAM",
        device_id=0,
        num_blocks=pool.num_blocks,
        layers=pool.layers,
        regions=pool.regions,
        block_bytes=pool.block_bytes,
        dtype=pool.dtype,
        kv_layout=pool.kv_layout,
        region_base_addrs=[base_addr + r * stride for r in range(pool.regions)],
        backends=["UCX"],
        nixl_version="fake",
        auth=False,
    )


class StubOptions(TypedDict, total=False):
    """``StubPeer``'s keyword options, for test helpers that pass them on (``**kw``)."""

    engine_id: str
    hold: bool
    error: str | None
    tp_size: int
    compat_hash: str | None
    auth: Authenticator | None
    port: int


class StubPeer:
    """A real side-channel server that answers handshakes like an ``Endpoint`` (no NIXL).

    ``hold=True`` keeps every handshake reply until ``release()``; ``error`` answers every
    handshake with that ``ErrorRep`` code; ``tamper`` may rewrite each ``HandshakeRep`` (a peer
    that lies or speaks another version). ``requests`` lists the handshake requests seen.
    """

    def __init__(
        self,
        role: Role = Role.DECODE,
        pool: PoolConfig | None = None,
        *,
        engine_id: str = "",
        hold: bool = False,
        error: str | None = None,
        tp_size: int = 1,
        compat_hash: str | None = None,
        auth: Authenticator | None = None,
        port: int = 0,
    ) -> None:
        self.role = role
        self.pool = pool or stub_pool()
        self.engine_id = engine_id or f"{role[0]}-stub-{uuid.uuid4().hex[:6]}"
        self.tp_size = tp_size
        self.hold = hold
        self.error = error
        self.forced_hash = compat_hash
        self.tamper: Callable[[protocol.HandshakeRep], protocol.HandshakeRep] | None = None
        self.requests: list[protocol.HandshakeReq] = []
        self.got_request = threading.Event()
        self._held: list[tuple[protocol.HandshakeReq, ReplyFn]] = []
        self._lock = threading.Lock()
        self.server = SideChannelServer(
            "127.0.0.1", port, self._handle, auth or Authenticator(None), name="stub-peer"
        )
        self.server.start()
        self.new_incarnation()

    # -- identity ---------------------------------------------------------------------------
    def new_incarnation(self) -> None:
        """Become a new incarnation (a restarted process at the same address)."""
        self.incarnation = uuid.uuid4().hex
        self.metadata = make_metadata(
            self.role,
            self.pool,
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            port=self.server.port,
            tp_size=self.tp_size,
        )

    @property
    def agent_name(self) -> str:
        return self.metadata.agent_name

    def agent_of(self, rank: int) -> str:
        """The agent name rank ``rank`` of this stub announces (rank 0: ``agent_name``)."""
        return self.metadata_of(rank).agent_name

    def metadata_of(self, rank: int) -> protocol.EndpointMetadata:
        md = self.metadata
        if rank == 0:
            return md
        return msgspec.structs.replace(md, tp_rank=rank, agent_name=f"{md.agent_name}.r{rank}")

    @property
    def key(self) -> tuple[str, int, int]:
        return ("127.0.0.1", self.server.port, 0)

    @property
    def address(self) -> str:
        return format_address(*self.key[:2])

    # -- serving ----------------------------------------------------------------------------
    def _handle(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        if not isinstance(req, protocol.HandshakeReq):
            reply(protocol.ErrorRep(rid=req.rid, code="unsupported", message="stub"))
            return
        with self._lock:
            self.requests.append(req)
            held = self.hold
            if held:
                self._held.append((req, reply))
        self.got_request.set()
        if not held:
            self._answer(req, reply)

    def _answer(self, req: protocol.HandshakeReq, reply: ReplyFn, error: str | None = None) -> None:
        code = error or self.error
        if code is not None:
            reply(protocol.ErrorRep(rid=req.rid, code=code, message=f"stub refuses: {code}"))
            return
        if req.tp_rank >= self.tp_size:
            reply(protocol.ErrorRep(rid=req.rid, code="no_such_rank", message="stub"))
            return
        md = self.metadata_of(req.tp_rank)
        rep = protocol.HandshakeRep(
            rid=req.rid,
            compat_hash=self.forced_hash or protocol.compat_hash(md),
            metadata=protocol.encode_metadata(md),
            agent_metadata=fake_agent_md(md.agent_name, full=req.mode == "full"),
            server_clock=time.time(),
        )
        reply(self.tamper(rep) if self.tamper is not None else rep)

    def release(self, error: str | None = None) -> int:
        """Answer every held handshake (with ``error`` as an ErrorRep code, if given)."""
        with self._lock:
            held, self._held = self._held, []
        for req, reply in held:
            self._answer(req, reply, error)
        return len(held)

    def let_go(self) -> None:
        """Hold nothing more: answer every held handshake, and any later one at once, with the
        error ``stopping`` (a teardown does this before it waits for D's handshakes to settle:
        a stub stopped first leaves a handshake on its way to wait out its deadline)."""
        self.hold = False
        self.release(error="stopping")

    def stop(self) -> None:
        self.let_go()
        self.server.stop()


class BlackHole:
    """A ZMQ ROUTER on 127.0.0.1 that accepts connections and never answers.

    Owned by the thread that created it (the test thread); ``close()`` there.
    """

    def __init__(self) -> None:
        self.sock = context().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        ep = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(ep, bytes)
        self.port = int(ep.decode().rsplit(":", 1)[1])

    @property
    def key(self) -> tuple[str, int, int]:
        return ("127.0.0.1", self.port, 0)

    @property
    def address(self) -> str:
        return format_address(*self.key[:2])

    def close(self) -> None:
        self.sock.close(0)


def as_agent(fake: FakeAgent) -> Agent:
    """``fake`` as the protocol type (mypy checks here that ``FakeAgent`` implements it)."""
    return fake


def decode_notif(data: bytes) -> protocol.Notif:
    """Decode a notification the writer sent (no token)."""
    from kvpush.wire.notifs import NotifCodec

    return NotifCodec(Authenticator(None)).decode(data)


def raw_msgpack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)
