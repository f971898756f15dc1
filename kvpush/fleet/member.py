"""An endpoint's membership of a fleet: its record, its registrar, its watch of the cluster.

``Membership(ep, cfg)`` is what ``serve-*`` runs with ``--registry``: a ``Registrar`` (its own
thread) keeps the endpoint's leased keys, and a ``PeerWatch`` (its own thread) follows the
cluster's *membership* only (``Follow(load=False)``: no load summary ever reaches it; every etcd
event it receives is counted, ``kvpush_registry_watch_events_total``). Both share the process's
one etcd client. A registry event is a hint, never proof: a peer this endpoint holds whose key
goes, or comes back with another incarnation, is looked at on its side channel
(``kvpush.fleet.suspects``) and dropped by every rank (``Endpoint.forget_peer``: ``peer_left`` /
``peer_restarted``) only when that proves it gone -- refused, or another incarnation answering
there. A lapsed lease of a live, frozen peer, an etcd stall, a deleted prefix or a wiped etcd
drop nobody. A departed peer's NIXL keys (``--nixl-metadata etcd``) are deleted by one member,
not all: the lowest address among the members publishing through etcd, in this member's view
(``PeerWatch.cleans``), after the same proof. With ``--prewarm`` every member the watch sees is
handed to a ``kvpush.fleet.prewarm.Prewarmer`` too. Neither thread is on the data path: they
hand the endpoint nothing but proven evictions (queued to the owner threads) and handshakes
started on its handshake threads.

``endpoint_record`` and ``load_of`` are pure functions of the endpoint and its snapshot.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol
from urllib.parse import urlsplit

from kvpush import __version__
from kvpush.address import binds_all_interfaces, format_address, parse_address
from kvpush.config import EndpointConfig, Role
from kvpush.errors import ConfigError, RegistryError, RegistryUnavailable
from kvpush.fleet.config import RegistryConfig
from kvpush.fleet.etcd import Etcd
from kvpush.fleet.prewarm import Prewarmer
from kvpush.fleet.record import EndpointRecord, Geometry, Load, MemberRecord
from kvpush.fleet.registrar import Registrar
from kvpush.fleet.store import FleetEvent, Follow
from kvpush.fleet.suspects import Hint, Suspects
from kvpush.peers.handshakes import PeerConn
from kvpush.peers.sighting import Sighting
from kvpush.telemetry.health import Verdict
from kvpush.telemetry.names import Counter
from kvpush.telemetry.snapshot import Snapshot
from kvpush.telemetry.store import Telemetry
from kvpush.wire import protocol

log = logging.getLogger(__name__)

NIXL_CLEANUP_DELAY_S = 1.0


class _Named(Protocol):
    @property
    def agent_name(self) -> str: ...


class _Bound(Protocol):
    @property
    def port(self) -> int: ...


class _Hashes(Protocol):
    def compat_hash(self, md: protocol.EndpointMetadata) -> str: ...


class Member(Protocol):
    """What a fleet member uses of its endpoint (``kvpush.endpoint.Endpoint``)."""

    @property
    def cfg(self) -> EndpointConfig: ...
    @property
    def incarnation(self) -> str: ...
    @property
    def metadata(self) -> protocol.EndpointMetadata: ...
    @property
    def dialect(self) -> _Hashes: ...
    @property
    def ranks(self) -> Sequence[_Named]: ...
    @property
    def server(self) -> _Bound: ...
    @property
    def telemetry(self) -> Telemetry: ...
    def snapshot(self) -> Snapshot: ...
    def holds_peer(self, address: str, incarnation: str | None) -> bool: ...
    def look_at_peer(self, address: str) -> Sighting: ...
    def forget_peer(self, address: str, incarnation: str | None, reason: str, why: str) -> None: ...
    def publish_nixl_metadata(self) -> None: ...
    def warm_peer(
        self, address: str, tp_size: int, engine_id: str
    ) -> Sequence[Future[PeerConn] | PeerConn]: ...


def advertised_address(bind_host: str, port: int, advertise: str | None) -> str:
    """The address the key is registered under: ``--advertise`` or the bind host."""
    host = (advertise or "").strip().strip("[]") or bind_host
    if binds_all_interfaces(host):
        raise ConfigError(
            f"cannot register {format_address(host, port)}: peers cannot reach the "
            "all-interfaces address",
            "give --advertise HOST (this machine's address as peers reach it)",
        )
    return format_address(host, port)


def load_of(snap: Snapshot) -> Load:
    """The load summary in a snapshot (free blocks, work in flight, cumulative outcomes)."""
    g, c = snap.gauges, snap.counters
    if snap.role == Role.PREFILL:
        in_flight = g.get("inflight_writes", 0) + g.get("deferred", 0)
        ok, failed = c.get("pushes_ok", 0), c.get("pushes_failed", 0)
    else:
        in_flight = g.get("d_waiting", 0)
        ok, failed = c.get("requests_ok", 0), c.get("requests_failed", 0)
    return Load(
        free_blocks=int(g.get("pool_free", 0)),
        in_flight=int(in_flight),
        pushes_total=int(ok),
        failures_total=int(failed),
        updated_at=time.time(),
    )


def endpoint_record(ep: Member, address: str, metrics_url: str = "") -> EndpointRecord:
    """What ``ep`` publishes (its load summary empty: the registrar fills it)."""
    cfg, md = ep.cfg, ep.metadata
    compat = ep.dialect.compat_hash(md)
    return EndpointRecord(
        role=cfg.role,
        engine_id=cfg.engine_id,
        incarnation=ep.incarnation,
        address=address,
        host=socket.gethostname(),
        pid=os.getpid(),
        tp_size=cfg.tp_size,
        wire=cfg.wire.value,
        geometry=Geometry.of(cfg.pool, str(md.device_kind)),
        compat_hash=compat,
        kvpush_version=__version__,
        nixl_version=md.nixl_version,
        metrics_url=metrics_url,
        started_at=time.time(),
        agent_names=[rk.agent_name for rk in ep.ranks],
        nixl_metadata="etcd" if cfg.agent.etcd_endpoints else "sidechannel",
        nixl_namespace=cfg.agent.etcd_namespace,
    )


def reachable_url(url: str, address: str) -> str:
    """``url`` with an all-interfaces host replaced by the advertised one (``address``'s)."""
    if not url:
        return url
    u = urlsplit(url)
    if u.hostname is None or not binds_all_interfaces(u.hostname):
        return url
    host, _ = parse_address(address)
    return u._replace(netloc=format_address(host, u.port or 80)).geturl()


def nixl_cleaner(own: str, gone: MemberRecord, members: Mapping[str, MemberRecord]) -> bool:
    """Whether the member at ``own`` (one that publishes its NIXL metadata through etcd) is the
    one that deletes the NIXL keys of ``gone``: the lowest address among the members of
    ``members`` (a view of the cluster) that publish through etcd, ``gone`` aside. Two members
    whose views differ for a moment may both delete, harmlessly (a delete of keys already gone);
    the others never try. Pure."""
    if gone.nixl_metadata != "etcd" or not gone.nixl_namespace:
        return False
    others = [
        a for a, r in members.items() if r.nixl_metadata == "etcd" and a not in (gone.address, own)
    ]
    return not others or own < min(others)


class PeerWatch:
    """Follows the cluster's membership on its own thread. A peer this endpoint holds that the
    registry says left or restarted is *suspected* and checked on its side channel
    (``Suspects``); it is dropped only on proof. The endpoint's own key going makes the
    registrar put it again."""

    def __init__(
        self,
        ep: Member,
        cfg: RegistryConfig,
        own: EndpointRecord,
        registrar: Registrar,
        etcd: Etcd,
        prewarm: Prewarmer | None = None,
    ) -> None:
        self._ep = ep
        self._own = own.address
        self._own_nixl_etcd = own.nixl_metadata == "etcd"
        self._registrar = registrar
        self._prewarm = prewarm
        tm = ep.telemetry
        tm.declare(
            counters=[Counter.REGISTRY_WATCH_EVENTS, Counter.PREWARMS, Counter.PREWARMS_FAILED]
        )
        self._follow = Follow(
            etcd,
            cfg.cluster,
            load=False,
            retry_s=min(1.0, cfg.refresh_s),
            on_events=lambda n: tm.inc(Counter.REGISTRY_WATCH_EVENTS, n),
        )
        self._etcd = etcd
        self._lock = threading.Lock()
        self._cleaning: set[tuple[str, str]] = set()  # (address, incarnation) this one cleans
        self.suspects = Suspects(ep, tm, self._proven)
        self._thread = threading.Thread(target=self._run, name="registry-watch", daemon=True)

    def start(self) -> None:
        self.suspects.start()
        if self._prewarm is not None:
            self._prewarm.start()
        self._thread.start()

    def stop(self) -> None:
        self._follow.cancel()
        self._thread.join(5.0)
        self.suspects.stop()
        if self._prewarm is not None:
            self._prewarm.stop()

    def _run(self) -> None:
        while not self._follow.cancelled:
            try:
                for ev in self._follow:
                    try:
                        self._on(ev)
                    except Exception:  # a bad event must not end the watch
                        log.exception(
                            "registry watch: handling %s of %s failed", ev.kind, ev.address
                        )
            except Exception:  # nor a bug in following: list and watch afresh
                if self._follow.cancelled:
                    return  # stopping: the stream was shut under the reader
                log.exception("registry watch failed: following the cluster again")
                time.sleep(1.0)

    def _on(self, ev: FleetEvent) -> None:
        kind, address, record, previous = ev.kind, ev.address, ev.record, ev.previous
        if address == self._own:
            if kind == "leave":
                self._registrar.put_again()
            return
        self._warm(ev)
        if record is not None:  # join, update, restart: this incarnation is registered again
            self.suspects.clear(address, record.incarnation)
            with self._lock:
                self._cleaning.discard((address, record.incarnation))
        if previous is None or kind not in ("leave", "restart"):
            return
        held = self._ep.holds_peer(address, previous.incarnation)
        say = log.info if held else log.debug  # only the peers it holds are this endpoint's news
        if kind == "leave" and previous.leaving:
            # A graceful stop: it drains what it holds and tells its peers itself (shutting_down).
            say("registry: %s left (a graceful stop: its work in flight drains)", address)
            return
        hint: Hint = "left" if kind == "leave" else "restarted"
        if held:
            say(
                "registry: %s %s (incarnation %s): a hint, not proof; looking at its side channel",
                address,
                hint,
                previous.incarnation[:12],
            )
        cleans = self.cleans(previous)
        if cleans:
            with self._lock:
                self._cleaning.add((address, previous.incarnation))
        if held or cleans:
            self.suspects.add(hint, previous, held)

    def _warm(self, ev: FleetEvent) -> None:
        """--prewarm: a member registered now is warmed (when compatible), one gone forgotten."""
        if self._prewarm is None:
            return
        if ev.record is not None:
            self._prewarm.want(ev.record)
        elif ev.kind == "leave":
            self._prewarm.forget(ev.address)

    def cleans(self, gone: EndpointRecord) -> bool:
        """Whether this endpoint deletes ``gone``'s NIXL keys once it is proven gone
        (``nixl_cleaner``, over this endpoint's view of the cluster)."""
        return self._own_nixl_etcd and nixl_cleaner(self._own, gone, self._follow.known)

    def _proven(self, previous: EndpointRecord) -> None:
        """A suspected peer is proven gone (checker thread): its NIXL keys go too, when this
        endpoint is the one that cleans them."""
        with self._lock:
            mine = (previous.address, previous.incarnation) in self._cleaning
            self._cleaning.discard((previous.address, previous.incarnation))
        if mine:
            # NIXL wrote the peer's agent metadata without a lease: delete it, so every NIXL
            # watcher drops the agent too. After a grace period: the owner threads release
            # their handles on the agent first (forget_peer only queued that).
            t = threading.Timer(NIXL_CLEANUP_DELAY_S, self._delete_nixl_keys, (previous,))
            t.daemon = True
            t.start()

    def _delete_nixl_keys(self, previous: EndpointRecord) -> None:
        for agent in previous.agent_names:
            prefix = f"{previous.nixl_namespace}/{agent}/"
            try:
                n = self._etcd.delete_prefix(prefix)
            except (RegistryUnavailable, RegistryError) as e:
                log.warning("registry: could not delete NIXL keys %s: %s", prefix, e)
                continue
            if n:
                log.info("registry: deleted %d NIXL metadata key(s) of %s", n, agent)


class Membership:
    """Register ``ep`` in ``cfg.cluster`` and follow the cluster (see the module docstring)."""

    def __init__(self, ep: Member, cfg: RegistryConfig, metrics_url: str = "") -> None:
        self.cfg = cfg
        self.address = advertised_address(ep.cfg.host, ep.server.port, cfg.advertise)
        self.record = endpoint_record(ep, self.address, reachable_url(metrics_url, self.address))
        self.etcd = Etcd(cfg.access)  # the process's one client: registrar, watch, cleaner
        self.registrar = Registrar(
            cfg,
            self.record,
            lambda: load_of(ep.snapshot()),
            ep.telemetry,
            ep.publish_nixl_metadata if self.record.nixl_metadata == "etcd" else None,
            etcd=self.etcd,
        )
        self.prewarm = (
            Prewarmer(ep, self.record, ep.telemetry, wait_s=ep.cfg.timeouts.handshake_s + 2.0)
            if ep.cfg.prewarm
            else None
        )
        self.watch = PeerWatch(ep, cfg, self.record, self.registrar, self.etcd, self.prewarm)

    def start(self) -> None:
        self.registrar.start()
        self.watch.start()
        log.info(
            "registry: registering %s in cluster %s%s",
            self.address,
            self.cfg.cluster,
            " (--prewarm: handshaking every compatible peer as it joins)" if self.prewarm else "",
        )

    def verdict(self) -> Verdict:
        return self.registrar.verdict()

    def leave(self) -> bool:
        """Graceful stop, before the drain: the key goes first, then the watch stops; whether
        the key was deleted (False: etcd did not answer, it lapses within the TTL)."""
        gone = self.registrar.leave()
        self.watch.stop()
        return gone
