"""The endpoint core: builds the shared resources complete, hands them to a role, stops them.

Composition: an ``Endpoint`` owns what P and D share -- KV pool, NIXL agent, side-channel server,
handshake manager, codec, telemetry, pinger -- and is handed a *role* factory (P's
``PrefillRole``, D's ``DecodeRole``) that it calls with the finished ``EndpointContext``. The
constructor does everything; when it returns the endpoint serves (there is no half-built,
Optional-until-start state); when it raises, what it had built is undone in reverse order.

Start order: pool -> NIXL agent (+ register the pool once) -> side channel (bound; answers "not
ready" until the end) -> metadata -> handshake manager -> role (its owner thread runs) -> ready.

Stop order (written down once, here): stop intake -> stop the side channel (D first finishes or
fails its waiting requests so their replies still go out) -> drain in-flight WRITEs (the role's
owner thread) -> release transfer and descriptor handles -> remove remote agents -> deregister
memory.

Threads owned: the side-channel server thread, the role's owner thread, short-lived handshake
threads and a small control executor for slow control requests (P fills blocks).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.config import EndpointConfig, HandshakeMode, Wire, format_address, parse_address
from kvpush.endpoint import answers
from kvpush.endpoint.ping import Pinger
from kvpush.errors import PeerUnreachableError
from kvpush.memory.allocator import BlockAllocator
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import HandshakeManager, PeerConn
from kvpush.runtime.context import EndpointContext, Role
from kvpush.telemetry.names import Counter, Gauge
from kvpush.telemetry.snapshot import Snapshot
from kvpush.telemetry.store import Telemetry
from kvpush.transport.nixl import NixlAgent, nixl_version
from kvpush.transport.sidechannel import ReplyFn, SideChannelServer
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import Authenticator
from kvpush.wire.notifs import Codec, NotifCodec, VllmNotifCodec

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Role)

_POOL_GAUGES = {
    Gauge.POOL_FREE: "free",
    Gauge.POOL_ALLOCATED: "allocated",
    Gauge.POOL_INFLIGHT: "inflight",
    Gauge.POOL_QUARANTINED: "quarantined",
    Gauge.POOL_TOTAL: "total",
}


class Endpoint(Generic[R]):
    def __init__(self, cfg: EndpointConfig, make_role: Callable[[EndpointContext], R]) -> None:
        self.cfg = cfg
        self.incarnation = uuid.uuid4().hex
        self.agent_name = f"{cfg.engine_id}#{self.incarnation[:12]}"
        self.telemetry = Telemetry(cfg.role, cfg.engine_id, self.incarnation)
        self.auth = Authenticator(cfg.auth_token)
        self.codec: Codec = (
            VllmNotifCodec(cfg.max_notif_bytes)
            if cfg.wire == Wire.VLLM
            else NotifCodec(self.auth, cfg.max_notif_bytes)
        )
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()
        self._control = ThreadPoolExecutor(max_workers=2, thread_name_prefix="control")
        with contextlib.ExitStack() as undo:
            undo.callback(self._control.shutdown, wait=False, cancel_futures=True)
            self.pool = KvPool(cfg.pool)
            self.agent = NixlAgent(self.agent_name, cfg.agent)
            undo.callback(self.agent.close)
            self.agent.register(self.pool.tensor)
            self.server = SideChannelServer(
                cfg.host,
                cfg.port,
                self._handle_request,
                self.auth,
                max_frame_bytes=cfg.max_frame_bytes,
                vllm_handler=self._answer_get_meta,
                on_reject=lambda kind: self.telemetry.fail(kind),
                name=f"sidechannel-{cfg.role}",
            )
            self.server.start()
            undo.callback(self.server.stop)
            self.metadata = self._build_metadata()
            self._md_bytes = protocol.encode_metadata(self.metadata)
            self._agent_md_full = self.agent.metadata_full()
            self._agent_md_conn = self.agent.metadata_conn_only()
            self.handshakes = HandshakeManager(
                self.agent,
                self.metadata,
                self.auth,
                cfg.timeouts,
                self.telemetry,
                wire=cfg.wire,
                vllm_wire=cfg.vllm,
            )
            undo.callback(self._release_peers)
            self.pinger = Pinger(
                self.agent,
                self.handshakes,
                self.codec,
                (cfg.host, self.server.port, cfg.tp_rank),
                cfg.timeouts.handshake_s + 2,
            )
            self.ctx = EndpointContext(
                cfg=cfg,
                agent=self.agent,
                pool=self.pool,
                handshakes=self.handshakes,
                codec=self.codec,
                telemetry=self.telemetry,
                metadata=self.metadata,
                on_ping=self.pinger.on_ping,
                control=self._control,
            )
            self.role: R = make_role(self.ctx)
            self._wire_telemetry()
            self.role.start()
            undo.pop_all()
        self._ready.set()
        log.info(
            "%s endpoint %s (%s) ready on %s: %d blocks x %d regions x %d B on %s",
            cfg.role,
            cfg.engine_id,
            self.agent_name,
            self.address,
            cfg.pool.num_blocks,
            cfg.pool.regions,
            cfg.pool.block_bytes,
            cfg.pool.device,
        )

    def _build_metadata(self) -> protocol.EndpointMetadata:
        cfg, pool = self.cfg, self.pool
        return protocol.EndpointMetadata(
            protocol_version=PROTOCOL_VERSION,
            kvpush_version=__version__,
            engine_id=cfg.engine_id,
            role=cfg.role,
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

    def _wire_telemetry(self) -> None:
        cfg, tm = self.cfg, self.telemetry
        info: dict[str, str | int | float] = {
            "address": self.address,
            "device": cfg.pool.device,
            "backends": ",".join(cfg.agent.backends),
            "version": __version__,
            "agent": self.agent_name,
            "auth": "on" if self.auth.enabled else "off",
            "progress_thread": "on" if cfg.agent.progress_thread else "off",
        }
        if cfg.role == "prefill":
            info["writer"] = cfg.writer_mode.value
        else:
            info["handshake"] = cfg.handshake_mode.value
        tm.info(**info)
        tm.peers_fn(self.handshakes.rows)
        allocator = self.pool.allocator
        for gauge, key in _POOL_GAUGES.items():
            tm.gauge_fn(gauge, functools.partial(_count, allocator, key))
        self.role.owner.export_gauges(tm)

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        return format_address(self.cfg.host, self.server.port)

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful, ordered shutdown (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        drain = self.cfg.timeouts.drain_s if timeout_s is None else timeout_s
        self._stopping.set()
        self.role.stop_intake(drain)
        self.server.stop()
        self.role.stop(drain)
        self._control.shutdown(wait=False, cancel_futures=True)
        self._release_peers()
        self.agent.close()
        log.info("%s endpoint %s stopped", self.cfg.role, self.cfg.engine_id)

    def _release_peers(self) -> None:
        for conn in self.handshakes.close():
            self.handshakes.release_conn(conn)

    def failure(self) -> BaseException | None:
        if self.server.failure is not None:
            return self.server.failure
        return self.role.failure()

    def snapshot(self) -> Snapshot:
        return self.telemetry.snapshot()

    # ------------------------------------------------------------------ side channel
    def _handle_request(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        if not self._ready.is_set():
            reply(
                protocol.ErrorRep(
                    rid=req.rid, code="not_ready", message="starting", hint="retry shortly"
                )
            )
            return
        if isinstance(req, protocol.HandshakeReq):
            self._reply_handshake(req, reply)
            return
        if isinstance(req, protocol.StatsReq):
            reply(protocol.StatsRep(rid=req.rid, snapshot=self.snapshot().to_dict()))
            return
        if self._stopping.is_set():
            reply(
                protocol.ErrorRep(
                    rid=req.rid,
                    code="not_ready",
                    message=f"{self.cfg.role} endpoint is shutting down",
                    hint="retry shortly",
                )
            )
            return
        if not self.role.handle(req, reply):
            reply(
                protocol.ErrorRep(
                    rid=req.rid,
                    code="unsupported",
                    message=f"a {self.cfg.role} endpoint does not serve {type(req).__name__}",
                    hint="send prefill requests to P and decode requests to D",
                )
            )

    def _reply_handshake(self, req: protocol.HandshakeReq, reply: ReplyFn) -> None:
        refusal = answers.refuse_handshake(self.cfg, req)
        if refusal is not None:
            reply(refusal)
            return
        self.telemetry.inc(Counter.HANDSHAKES_SERVED)
        agent_md = self._agent_md_full if req.mode == "full" else self._agent_md_conn
        rep = protocol.HandshakeRep(
            rid=req.rid,
            compat_hash=protocol.compat_hash(self.metadata),
            metadata=self._md_bytes,
            agent_metadata=agent_md,
            server_clock=0.0,
        )

        def send() -> None:
            import msgspec

            reply(msgspec.structs.replace(rep, server_clock=time.time()))

        delay = self.cfg.handshake_reply_delay_s
        if delay > 0:
            t = threading.Timer(delay, send)
            t.daemon = True
            t.start()
        else:
            send()

    def _answer_get_meta(self, pp_rank: int, tp_rank: int) -> list[bytes]:
        """Answer vLLM's ``get_meta_msg`` (every client's first contact) in vLLM's form."""
        md = self.metadata if self._ready.is_set() else None
        payload = answers.get_meta_payload(
            md, self.cfg, self.auth.enabled, self._agent_md_full, (pp_rank, tp_rank)
        )
        return vllm.encode_get_meta_reply(payload, time.perf_counter())

    # ------------------------------------------------------------------ probes
    def handshake_to(self, address: str, mode: HandshakeMode) -> PeerConn:
        """A real NIXL handshake to another endpoint (used by ``kvpush probe --handshake``)."""
        host, port = parse_address(address)
        key = (host, port, 0)
        t = self.cfg.timeouts.handshake_s + 1
        try:
            return self.handshakes.handshake_sync(key, mode, t)
        except TimeoutError:
            raise PeerUnreachableError(
                f"handshake with {address} did not finish in {t:g}s"
            ) from None

    def ping(self, address: str, count: int) -> list[float]:
        """NIXL notification round trips to ``address`` (the first, warm-up trip excluded)."""
        conn = self.handshake_to(address, HandshakeMode.NOTIF)
        return self.pinger.ping(conn, count, self.role.poke)


def _count(allocator: BlockAllocator, key: str) -> float:
    return allocator.counts()[key]
