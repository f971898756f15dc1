"""One tensor-parallel rank of an endpoint: its own NIXL agent, KV pool, handshakes and role.

A rank is what a vLLM worker is to its engine: rank ``r`` of an endpoint at TP ``n`` registers
its own pool (on ``cuda:r`` with ``--device cuda``), answers for ``(0, r)`` on the endpoint's
one side channel, handshakes and writes or receives with its own agent, and runs its own role
(P's writer or D's receiver) on its own owner thread. Ranks share nothing but the side channel,
the control executor and the endpoint's identity (engine id, incarnation), the wire and what
they learn of peers: one ``Shared``, built by the endpoint and handed to each rank.

Built complete by the constructor (undone in reverse when a step raises); ``start`` starts the
role's owner thread. Runs on the caller's thread; the rank's threads are its role's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.config import EndpointConfig, Role, Wire
from kvpush.endpoint.ping import Pinger
from kvpush.instruments import Instruments
from kvpush.memory.pool import KvPool
from kvpush.peers.dialect import Dialect
from kvpush.peers.handshakes import HandshakeManager
from kvpush.runtime.context import EndpointContext, RoleWorker
from kvpush.runtime.decline import Decliner
from kvpush.telemetry.names import Gauge
from kvpush.telemetry.store import Telemetry
from kvpush.transport.nixl import NixlAgent, nixl_version
from kvpush.transport.versions import local_versions
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator
from kvpush.wire.notifs import Codec

log = logging.getLogger(__name__)

R = TypeVar("R", bound=RoleWorker)

_POOL_GAUGES = {
    Gauge.POOL_FREE: "free",
    Gauge.POOL_ALLOCATED: "allocated",
    Gauge.POOL_INFLIGHT: "inflight",
    Gauge.POOL_QUARANTINED: "quarantined",
    Gauge.POOL_TOTAL: "total",
}


def agent_name(engine_id: str, incarnation: str, rank: int) -> str:
    """A fresh NIXL agent name per incarnation and rank (DESIGN.md: never reuse one)."""
    base = f"{engine_id}#{incarnation[:12]}"
    return base if rank == 0 else f"{base}.r{rank}"


@dataclass(frozen=True)
class Shared:
    """What every rank of an endpoint shares: its identity, side channel, authenticator,
    control executor, what it learns of its peers, and the wire it speaks."""

    incarnation: str
    port: int  # the side channel's
    auth: Authenticator
    control: ThreadPoolExecutor
    decliner: Decliner | None
    instruments: Instruments
    dialect: Dialect  # chosen once per endpoint
    # Peers' TP sizes by side-channel address (D learns P's once, for all its ranks).
    peer_tp: dict[tuple[str, int], int] = field(default_factory=dict)


class Rank(Generic[R]):
    def __init__(
        self, cfg: EndpointConfig, shared: Shared, make_role: Callable[[EndpointContext], R]
    ) -> None:
        self.cfg = cfg
        self.instruments = shared.instruments
        self.rank = cfg.tp_rank
        self.agent_name = agent_name(cfg.engine_id, shared.incarnation, self.rank)
        self.telemetry = Telemetry(cfg.role, cfg.engine_id, shared.incarnation)
        dialect = shared.dialect
        codec: Codec = dialect.codec
        auth, port = shared.auth, shared.port
        with contextlib.ExitStack() as undo:
            self.pool = KvPool(cfg.pool, rank=self.rank)
            self.agent = NixlAgent(self.agent_name, cfg.agent)
            undo.callback(self.agent.close)
            pool = self.pool
            self.agent.register_region(
                pool.base_addr, pool.nbytes, pool.device_kind, pool.device_id
            )
            self.metadata = self._build_metadata(shared.incarnation, port, auth)
            self.md_bytes = protocol.encode_metadata(self.metadata)
            self.agent_md_full = self.agent.metadata_full()
            self.agent_md_conn = self.agent.metadata_conn_only()
            if self.agent.etcd_metadata:
                self.agent.publish()
                undo.callback(self.agent.withdraw)
            self.handshakes = HandshakeManager(
                self.agent,
                self.metadata,
                auth,
                cfg.timeouts,
                self.telemetry,
                dialect=dialect,
                error_limit=cfg.evict_after_errors,
            )
            undo.callback(self.release_peers)
            self.pinger = Pinger(
                self.agent,
                self.handshakes,
                codec,
                (cfg.host, port, self.rank),
                cfg.timeouts.handshake_s + 2,
            )
            ctx = EndpointContext(
                cfg=cfg,
                agent=self.agent,
                pool=self.pool,
                handshakes=self.handshakes,
                codec=codec,
                dialect=dialect,
                telemetry=self.telemetry,
                metadata=self.metadata,
                on_ping=self.pinger.on_ping,
                control=shared.control,
                peer_tp=shared.peer_tp,
                decliner=shared.decliner,
                instruments=shared.instruments,
            )
            self.role: R = make_role(ctx)
            self._wire_telemetry(auth)
            undo.pop_all()

    def _build_metadata(
        self, incarnation: str, port: int, auth: Authenticator
    ) -> protocol.EndpointMetadata:
        cfg, pool = self.cfg, self.pool
        return protocol.EndpointMetadata(
            protocol_version=PROTOCOL_VERSION,
            kvpush_version=__version__,
            engine_id=cfg.engine_id,
            role=cfg.role,
            incarnation=incarnation,
            agent_name=self.agent_name,
            host=cfg.host,
            port=port,
            tp_rank=self.rank,
            tp_size=cfg.tp_size,
            device_kind=pool.device_kind,
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
            auth=auth.enabled,
            kv_heads=cfg.pool.kv_heads,
            tp_ranks=list(range(cfg.tp_size)),
            ucx_version=local_versions().ucx,
            takes_push_regs=cfg.coalesce and cfg.role is Role.PREFILL and cfg.wire is Wire.KVPUSH,
        )

    def _wire_telemetry(self, auth: Authenticator) -> None:
        cfg, tm = self.cfg, self.telemetry
        info: dict[str, str | int | float] = {
            "device": str(self.pool.device),
            "backends": ",".join(cfg.agent.backends),
            "version": __version__,
            "agent": self.agent_name,
            "auth": "on" if auth.enabled else "off",
            "progress_thread": "on" if cfg.agent.progress_thread else "off",
            "wire": cfg.wire.value,
            "rank": self.rank,
            "tp_size": cfg.tp_size,
        }
        if cfg.role == Role.PREFILL:
            info["writer"] = self.instruments.writer.value
        else:
            info["handshake"] = cfg.handshake_mode.value
        tm.info(**info)
        tm.peers_fn(self.handshakes.rows)
        for gauge, key in _POOL_GAUGES.items():
            tm.gauge_fn(gauge, functools.partial(_count, self.pool, key))
        for gauge in (Gauge.POOL_FREE_RUNS, Gauge.POOL_LARGEST_FREE_RUN, Gauge.ALLOC_MEAN_RUN_LEN):
            tm.gauge_fn(gauge, functools.partial(_fragmentation, self.pool, gauge))
        tm.gauge_fn(Gauge.REMOTE_AGENTS, lambda: len(self.agent.remote_agents()))
        tm.gauge_fn(Gauge.STALE_AGENT_USES, lambda: self.agent.stale_agent_uses)
        self.role.owner.export_gauges(tm)

    def release_peers(self) -> None:
        for conn in self.handshakes.close():
            self.handshakes.release_conn(conn)

    def close(self) -> None:
        """After the role stopped: remove remote agents, deregister memory."""
        self.release_peers()
        if self.agent.etcd_metadata:
            self.agent.withdraw()
        self.agent.close()


def _count(pool: KvPool, key: str) -> float:
    return pool.allocator.counts()[key]


def _fragmentation(pool: KvPool, gauge: Gauge) -> float:
    return pool.allocator.fragmentation().gauges()[gauge]
