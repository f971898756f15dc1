"""What P and D endpoints share: lifecycle, pool, NIXL agent, side channel, handshakes, ping.

Start order: pool -> NIXL agent (+ register the pool once) -> side channel (bound; answers
"not ready" until the end of start) -> handshake manager -> the role's owner thread (P's writer,
D's receiver) -> ready. ``start`` returns once everything runs, or raises the first error after
undoing what was started.

Stop order (written down once, here): stop intake -> stop the side channel (D first finishes or
fails its waiting requests so their replies still go out) -> drain in-flight WRITEs -> release
transfer and descriptor handles -> remove remote agents -> deregister memory.

Threads owned: the side-channel server thread, the role's owner thread, short-lived handshake
threads and a small control executor for slow control requests (prefill fills blocks).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.config import EndpointConfig, HandshakeMode, format_address, parse_address
from kvpush.errors import KvpushError, PeerUnreachableError, ShuttingDownError
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import HandshakeManager, HandshakeResult, PeerConn
from kvpush.telemetry.snapshot import Snapshot
from kvpush.telemetry.store import Telemetry
from kvpush.transport.nixl import NixlAgent, nixl_version
from kvpush.transport.sidechannel import ReplyFn, SideChannelServer
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import Authenticator
from kvpush.wire.notifs import NotifCodec

log = logging.getLogger(__name__)


class Endpoint:
    role: str = ""
    expect_peer_role: str | None = None

    def __init__(self, cfg: EndpointConfig) -> None:
        if cfg.role != self.role:
            raise ValueError(f"{type(self).__name__} needs role {self.role}, got {cfg.role}")
        self.cfg = cfg
        self.incarnation = uuid.uuid4().hex
        self.agent_name = f"{cfg.engine_id}#{self.incarnation[:12]}"
        self.telemetry = Telemetry(cfg.role, cfg.engine_id, self.incarnation)
        self.auth = Authenticator(cfg.auth_token)
        self.codec = NotifCodec(self.auth, cfg.max_notif_bytes)
        self.pool: KvPool | None = None
        self.agent: NixlAgent | None = None
        self.server: SideChannelServer | None = None
        self.handshakes: HandshakeManager | None = None
        self.metadata: protocol.EndpointMetadata | None = None
        self._md_bytes = b""
        self._agent_md_full = b""
        self._agent_md_conn = b""
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()
        self._control = ThreadPoolExecutor(max_workers=2, thread_name_prefix="control")
        self._ping_waiters: dict[int, Future[float]] = {}
        self._ping_seq = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        assert self.server is not None, "endpoint not started"
        return format_address(self.cfg.host, self.server.port)

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self._teardown(drain_s=0.0)
            raise
        self._ready.set()
        log.info(
            "%s endpoint %s (%s) ready on %s: %d blocks x %d regions x %d B on %s",
            self.role,
            self.cfg.engine_id,
            self.agent_name,
            self.address,
            self.cfg.pool.num_blocks,
            self.cfg.pool.regions,
            self.cfg.pool.block_bytes,
            self.cfg.pool.device,
        )

    def _start(self) -> None:
        cfg = self.cfg
        self.pool = KvPool(cfg.pool)
        self.agent = NixlAgent(self.agent_name, cfg.agent)
        self.agent.register(self.pool.tensor)
        self.server = SideChannelServer(
            cfg.host,
            cfg.port,
            self._handle_request,
            self.auth,
            max_frame_bytes=cfg.max_frame_bytes,
            vllm_handler=self._answer_get_meta,
            on_reject=lambda kind: self.telemetry.fail(kind),
            name=f"sidechannel-{self.role}",
        )
        self.server.start()
        pool = self.pool
        self.metadata = protocol.EndpointMetadata(
            protocol_version=PROTOCOL_VERSION,
            kvpush_version=__version__,
            engine_id=cfg.engine_id,
            role=self.role,  # type: ignore[arg-type]
            incarnation=self.incarnation,
            agent_name=self.agent_name,
            host=cfg.host,
            port=self.server.port,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            device_kind=pool.device_kind,  # type: ignore[arg-type]
            device_id=pool.device_id,
            num_blocks=cfg.pool.num_blocks,
            layers=cfg.pool.layers,
            regions=cfg.pool.regions,
            block_bytes=cfg.pool.block_bytes,
            dtype=cfg.pool.dtype,
            kv_layout=cfg.pool.kv_layout,
            region_base_addrs=pool.region_base_addrs(),
            backends=list(cfg.agent.backends),
            nixl_version=nixl_version(),
            auth=self.auth.enabled,
        )
        self._md_bytes = protocol.encode_metadata(self.metadata)
        self._agent_md_full = self.agent.metadata_full()
        self._agent_md_conn = self.agent.metadata_conn_only()
        self.handshakes = HandshakeManager(
            self.agent,
            self.metadata,
            self.auth,
            cfg.timeouts,
            self.telemetry,
            expect_role=None,
        )
        tm = self.telemetry
        tm.info(
            address=self.address,
            device=cfg.pool.device,
            backends=",".join(cfg.agent.backends),
            version=__version__,
            agent=self.agent_name,
            writer=cfg.writer_mode.value,
            handshake=cfg.handshake_mode.value,
            auth="on" if self.auth.enabled else "off",
            progress_thread="on" if cfg.agent.progress_thread else "off",
        )
        hs = self.handshakes
        tm.peers_fn(hs.rows)
        for state in ("free", "allocated", "inflight", "quarantined", "total"):
            tm.gauge_fn(f"pool_{state}", partial(_pool_count, pool, state))
        self._start_role()

    def _start_role(self) -> None:
        raise NotImplementedError

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful, ordered shutdown (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        drain = self.cfg.timeouts.drain_s if timeout_s is None else timeout_s
        self._stopping.set()
        self._teardown(drain)

    def _teardown(self, drain_s: float) -> None:
        self._stopping.set()
        self._stop_role_intake(drain_s)
        if self.server is not None:
            self.server.stop()
        self._stop_role(drain_s)
        self._control.shutdown(wait=False, cancel_futures=True)
        if self.handshakes is not None:
            for conn in self.handshakes.close():
                self.handshakes.release_conn(conn)
        if self.agent is not None:
            self.agent.close()
        log.info("%s endpoint %s stopped", self.role, self.cfg.engine_id)

    def _stop_role_intake(self, drain_s: float) -> None:
        """Role hook: refuse new work (D also finishes or fails waiting requests)."""

    def _stop_role(self, drain_s: float) -> None:
        """Role hook: drain and stop the owner thread."""

    def failure(self) -> BaseException | None:
        if self.server is not None and self.server.failure is not None:
            return self.server.failure
        return self._role_failure()

    def _role_failure(self) -> BaseException | None:
        return None

    def snapshot(self) -> Snapshot:
        return self.telemetry.snapshot()

    # ------------------------------------------------------------------ side channel
    def _handle_request(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        if isinstance(req, protocol.HandshakeReq):
            self._reply_handshake(req, reply)
            return
        if isinstance(req, protocol.StatsReq):
            snap = self.snapshot()
            reply(protocol.StatsRep(rid=req.rid, snapshot=snap.to_dict()))
            return
        if not self._ready.is_set() or self._stopping.is_set():
            reply(
                protocol.ErrorRep(
                    rid=req.rid,
                    code="not_ready",
                    message=f"{self.role} endpoint is "
                    + ("shutting down" if self._stopping.is_set() else "starting"),
                    hint="retry shortly",
                )
            )
            return
        self._handle_role_request(req, reply)

    def _handle_role_request(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        reply(
            protocol.ErrorRep(
                rid=req.rid,
                code="unsupported",
                message=f"a {self.role} endpoint does not serve {type(req).__name__}",
                hint="send prefill requests to P and decode requests to D",
            )
        )

    def _reply_handshake(self, req: protocol.HandshakeReq, reply: ReplyFn) -> None:
        if not self._ready.is_set() or self.metadata is None:
            reply(protocol.ErrorRep(rid=req.rid, code="not_ready", message="starting"))
            return
        self.telemetry.inc("handshakes_served")
        agent_md = self._agent_md_full if req.mode == "full" else self._agent_md_conn

        def send() -> None:
            assert self.metadata is not None
            reply(
                protocol.HandshakeRep(
                    rid=req.rid,
                    compat_hash=protocol.compat_hash(self.metadata),
                    metadata=self._md_bytes,
                    agent_metadata=agent_md,
                    server_clock=time.time(),
                )
            )

        delay = self.cfg.handshake_reply_delay_s
        if delay > 0:
            t = threading.Timer(delay, send)
            t.daemon = True
            t.start()
        else:
            send()

    def _answer_get_meta(self, pp_rank: int, tp_rank: int) -> list[bytes]:
        """Answer vLLM's ``get_meta_msg`` (every client's first contact) in vLLM's form.

        The payload says "kvpush" under the extra key vLLM's decoder ignores, and carries no
        NIXL metadata: its compatibility hash can never equal a vLLM engine's, and its empty
        ``agent_metadata_bytes`` fail vLLM's decoder cleanly, so a vLLM engine that asks stops
        before it could load anything. With a token set, only "kvpush, token needed" is told.
        """
        md = self.metadata
        if self.auth.enabled or md is None:
            ident = vllm.KvpushIdentity(
                protocol=PROTOCOL_VERSION,
                auth=self.auth.enabled,
                error="" if md is not None else "starting",
            )
            payload = vllm.HandshakePayload("", b"", ident)
        else:
            served = (pp_rank, tp_rank) == (0, md.tp_rank)
            ident = vllm.KvpushIdentity(
                protocol=PROTOCOL_VERSION,
                version=__version__,
                wire="kvpush",
                role=md.role,
                engine_id=md.engine_id,
                incarnation=md.incarnation,
                tp_size=md.tp_size,
                ranks=[(0, md.tp_rank)],
                error="" if served else f"rank ({pp_rank}, {tp_rank}) is not served here",
            )
            payload = vllm.HandshakePayload("kvpush:" + protocol.compat_hash(md), b"", ident)
        return vllm.encode_get_meta_reply(payload, time.perf_counter())

    # ------------------------------------------------------------------ probes
    def handshake_to(self, address: str, mode: HandshakeMode) -> HandshakeResult:
        """A real NIXL handshake to another endpoint (used by ``kvpush probe --handshake``)."""
        assert self.handshakes is not None
        key = parse_address(address)
        t = self.cfg.timeouts.handshake_s + 1
        try:
            return self.handshakes.handshake_sync(key, mode, t)
        except TimeoutError:
            raise PeerUnreachableError(
                f"handshake with {address} did not finish in {t:g}s"
            ) from None

    def ping(self, address: str, count: int) -> list[float]:
        """NIXL notification round trips to ``address`` (the first, warm-up trip excluded)."""
        assert self.agent is not None and self.server is not None
        conn = self.handshake_to(address, HandshakeMode.NOTIF)
        out: list[float] = []
        for i in range(count + 1):
            with self._lock:
                self._ping_seq += 1
                seq = self._ping_seq
                fut: Future[float] = Future()
                self._ping_waiters[seq] = fut
            t0 = time.perf_counter()
            self.agent.send_notif(
                conn.agent_name,
                self.codec.encode(
                    protocol.Ping(
                        seq=seq,
                        reply_host=self.cfg.host,
                        reply_port=self.server.port,
                        sent_at=time.time(),
                    )
                ),
            )
            self._poke_owner()
            try:
                t1 = fut.result(self.cfg.timeouts.handshake_s + 2)
            except TimeoutError:
                raise PeerUnreachableError(
                    f"{address} did not answer NIXL ping {i} in time"
                ) from None
            finally:
                self._ping_waiters.pop(seq, None)
            if i > 0:
                out.append(t1 - t0)
        return out

    def _poke_owner(self) -> None:
        """Wake the owner thread so it polls notifications right away."""

    def _on_ping(self, sender: str, msg: protocol.Ping) -> None:
        """Called on the owner thread for every Ping notification."""
        if msg.reply:
            fut = self._ping_waiters.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(time.perf_counter())
            return
        assert self.handshakes is not None and self.agent is not None
        key = (msg.reply_host, msg.reply_port)
        agent = self.agent
        codec = self.codec

        def answer(conn: PeerConn) -> None:
            try:
                agent.send_notif(
                    conn.agent_name, codec.encode(protocol.Ping(seq=msg.seq, reply=True))
                )
            except KvpushError as e:
                log.debug("ping reply failed: %s", e)

        hs_fut = self.handshakes.ensure(key, HandshakeMode.NOTIF)
        if hs_fut is None:
            conn = self.handshakes.get(key)
            if conn is not None:
                answer(conn)
            return

        def done(f: Future[PeerConn]) -> None:
            if f.exception() is None:
                answer(f.result())

        hs_fut.add_done_callback(done)


def _pool_count(pool: KvPool, state: str) -> float:
    return pool.allocator.counts()[state]


def create_endpoint(cfg: EndpointConfig) -> Endpoint:
    if cfg.role == "prefill":
        from kvpush.prefill.endpoint import PrefillEndpoint

        return PrefillEndpoint(cfg)
    from kvpush.decode.endpoint import DecodeEndpoint

    return DecodeEndpoint(cfg)


__all__ = ["Endpoint", "ShuttingDownError", "create_endpoint"]
