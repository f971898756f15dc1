"""The endpoint core: builds the shared resources complete, hands them to its ranks, stops them.

Composition: an ``Endpoint`` owns what every rank shares -- the side-channel server, the
authenticator, the control executor, its identity (engine id, incarnation) -- and one ``Rank``
per tensor-parallel rank (``kvpush.endpoint.rank``: its own KV pool, NIXL agent, handshake
manager, pinger, telemetry and role -- P's ``PrefillRole`` or D's ``DecodeRole``, each on its own
owner thread). A *group* (P's ``PrefillGroup``, D's ``DecodeGroup``) serves the side-channel
requests for all ranks at once; a load generator calls the same groups' paths through the
endpoint's own verbs (``prefill``, ``finish``, ``decode``...: ``kvpush.endpoint.load``). The
constructor does everything; when it returns the endpoint serves (there is no half-built,
Optional-until-start state); when it raises, what it had built is undone in reverse order.

Process model: ranks are threads of one process (README, "Tensor parallelism", has the
measurement). A rank whose owner thread dies is contained like any thread failure: its
requests fail with a reason, ``failure()`` names the rank, the other ranks keep serving.

Start order: side channel (bound; answers "not ready" until the end) -> per rank: pool -> NIXL
agent (+ register the pool once) -> metadata -> handshake manager -> role -> every role's owner
thread -> ready.

Stop order (written down once, here): stop intake -> stop the side channel (D first finishes or
fails its waiting requests so their replies still go out) -> drain in-flight WRITEs (each role's
owner thread) -> release transfer and descriptor handles -> remove remote agents -> deregister
memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar

from kvpush.address import format_address, parse_address
from kvpush.config import EndpointConfig, HandshakeMode, Role
from kvpush.endpoint import answers
from kvpush.endpoint.load import LoadVerbs
from kvpush.endpoint.rank import Rank, Shared
from kvpush.errors import KvpushError, PeerUnreachableError
from kvpush.instruments import NO_INSTRUMENTS, Instruments
from kvpush.memory.pool import KvPool
from kvpush.peers.dialect import dialect_for
from kvpush.peers.handshakes import HandshakeManager, PeerConn, PeerGone
from kvpush.peers.sighting import Sighting, look
from kvpush.peers.warm import Warm, warm
from kvpush.runtime.context import EndpointContext, RoleWorker
from kvpush.runtime.decline import Decliner
from kvpush.runtime.watchdog import Watchdog
from kvpush.telemetry.merge import merge
from kvpush.telemetry.names import REQUEST_COUNTERS, REQUEST_HISTS, Counter, Failure
from kvpush.telemetry.snapshot import Snapshot
from kvpush.telemetry.store import Telemetry
from kvpush.transport.sidechannel import ReplyFn, SideChannelServer
from kvpush.transport.versions import local_versions, warnings_for
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import Authenticator

log = logging.getLogger(__name__)


class Group(Protocol):
    """Serves an endpoint's side-channel requests for all of its ranks."""

    def handle(self, req: protocol.SideRequest, reply: ReplyFn) -> bool:
        """Serve a role request (True), or leave it to the endpoint (False)."""
        ...

    def close(self) -> None:
        """Stop what the group runs itself (P's push-wait timers), after the side channel."""
        ...


R = TypeVar("R", bound=RoleWorker)
G = TypeVar("G", bound=Group)


class Endpoint(LoadVerbs, Generic[R, G]):
    """One started P or D endpoint (see the module docstring); a load generator drives it with
    the verbs of ``LoadVerbs`` (``kvpush.endpoint.load``)."""

    def __init__(
        self,
        cfg: EndpointConfig,
        make_role: Callable[[EndpointContext], R],
        make_group: Callable[[list[R], Telemetry | None], G],
        instruments: Instruments = NO_INSTRUMENTS,
    ) -> None:
        self.cfg = cfg
        self.instruments = instruments
        self.incarnation = uuid.uuid4().hex
        self.auth = Authenticator(cfg.auth_token)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        # Set (under ``_gate``) once the roles stop: from then on the side channel answers no
        # handshake and no first contact with metadata, so no peer registers with roles that
        # stopped; it stays up only so the answers of what the roles ended reach their clients.
        self._closing = threading.Event()
        self._gate = threading.Lock()
        self._stopped = False
        self._lock = threading.Lock()
        self._control = ThreadPoolExecutor(max_workers=2, thread_name_prefix="control")
        # Request-level counts of a multi-rank endpoint (each rank counts its own share).
        self._group_tm = (
            Telemetry(cfg.role, cfg.engine_id, self.incarnation) if cfg.tp_size > 1 else None
        )
        if self._group_tm is not None:
            self._group_tm.declare(
                counters=REQUEST_COUNTERS[cfg.role], histograms=REQUEST_HISTS[cfg.role]
            )
        self.ranks: list[Rank[R]] = []
        # vLLM's wire has no such message: a vLLM peer would drop the connection on it.
        self.dialect = dialect_for(cfg, self.auth)  # the wire, chosen once: ranks share it
        self.decliner = Decliner(self.auth, cfg.timeouts) if self.dialect.declines else None
        with contextlib.ExitStack() as undo:
            undo.callback(self._control.shutdown, wait=False, cancel_futures=True)
            if self.decliner is not None:
                undo.callback(self.decliner.close)
            self.server = SideChannelServer(
                cfg.host,
                cfg.port,
                self._handle_request,
                self.auth,
                max_frame_bytes=cfg.max_frame_bytes,
                get_meta=self._answer_get_meta,
                on_reject=self._rejected,
                name=f"sidechannel-{cfg.role}",
            )
            self.server.start()
            undo.callback(self.server.stop)
            if instruments.start_delay_s > 0:  # a slow start, "starting" meanwhile
                time.sleep(instruments.start_delay_s)
            shared = Shared(
                self.incarnation,
                self.server.port,
                self.auth,
                self._control,
                self.decliner,
                instruments,
                self.dialect,
            )
            for r in range(cfg.tp_size):
                rank = Rank(dataclasses.replace(cfg, tp_rank=r), shared, make_role)
                undo.callback(rank.close)
                self.ranks.append(rank)
            if self.decliner is not None:
                self.decliner.telemetry = self.ranks[0].telemetry
            self.group: G = make_group([rk.role for rk in self.ranks], self._group_tm)
            for rk in self.ranks:
                rk.telemetry.info(address=self.address)
                rk.role.start()
                undo.callback(rk.role.stop, 1.0)
            undo.pop_all()
        self.watchdog = self._start_watchdog()
        self._ready.set()
        self._log_ready()

    def _log_ready(self) -> None:
        """Say the endpoint is ready, and warn of known issues of the NIXL/UCX in use."""
        cfg = self.cfg
        pc = cfg.pool
        log.info(
            "%s endpoint %s (%s) ready on %s: %d rank(s) x %d blocks x %d regions x %d B on %s",
            cfg.role,
            cfg.engine_id,
            self.agent_name,
            self.address,
            cfg.tp_size,
            pc.num_blocks,
            pc.regions,
            pc.block_bytes,
            pc.device,
        )
        # Releases known to be affected by bugs an endpoint meets (kvpush.transport.versions).
        for w in warnings_for(local_versions()):
            log.warning("known issue of the NIXL/UCX in use: %s", w)

    def _start_watchdog(self) -> Watchdog | None:
        """Watch the side channel (counted on rank 0) and every rank's owner thread (counted on
        its rank); ``--watchdog-timeout 0``: none."""
        if not self.cfg.timeouts.watchdog_s:
            return None
        wd = Watchdog(self.cfg.timeouts.watchdog_s, name=f"watchdog-{self.cfg.role}")
        wd.watch(self.server.heartbeat, self.ranks[0].telemetry)
        for rk in self.ranks:
            wd.watch(rk.role.owner.heartbeat, rk.telemetry)
        wd.start()
        return wd

    def _rejected(self, kind: str) -> None:
        """A side-channel frame was refused (counted on rank 0, whose telemetry is the
        endpoint's first)."""
        if self.ranks:
            self.ranks[0].telemetry.fail(kind)

    # Rank 0's resources, for tools and tests that look at one rank.
    @property
    def agent_name(self) -> str:
        return self.ranks[0].agent_name

    @property
    def pool(self) -> KvPool:
        return self.ranks[0].pool

    @property
    def handshakes(self) -> HandshakeManager:
        return self.ranks[0].handshakes

    @property
    def metadata(self) -> protocol.EndpointMetadata:
        return self.ranks[0].metadata

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
        dead = self.failure()
        if isinstance(dead, RankFailure):
            # The others' work ends with the reason that stopped them, not "shutting down".
            why = (
                Failure.RANK_FAILED,
                f"{'P' if self.cfg.role == Role.PREFILL else 'D'} rank {dead.rank} failed: "
                f"{type(dead.error).__name__}: {dead.error}",
            )
            for rk in self.ranks:
                rk.role.owner.stop_reason = why
        for rk in self.ranks:
            rk.role.stop_intake(drain)
        with self._gate:  # no handshake is being answered now, and none will be
            self._closing.set()
        self.group.close()
        for rk in self.ranks:
            rk.role.stop(drain)
        self.server.stop()  # after the roles: what their stop ended is answered to its clients
        self._control.shutdown(wait=False, cancel_futures=True)
        if self.decliner is not None:
            self.decliner.close()  # what the drains declined reaches the peers
        for rk in self.ranks:
            rk.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        log.info("%s endpoint %s stopped", self.cfg.role, self.cfg.engine_id)

    @property
    def stopping(self) -> bool:
        """True once ``stop()`` began (the endpoint refuses new work)."""
        return self._stopping.is_set()

    @property
    def telemetry(self) -> Telemetry:
        """Where endpoint-wide events are counted (rank 0's store, the endpoint's first)."""
        return self.ranks[0].telemetry

    def holds_peer(self, address: str, incarnation: str | None) -> bool:
        """Whether any rank holds a connection to the peer endpoint at ``address`` (matched by
        ``incarnation`` when given, whatever address it was reached by)."""
        host, port = parse_address(address)
        g = PeerGone(host, port, incarnation, Failure.PEER_LEFT, "")
        return any(rk.handshakes.gone(g) for rk in self.ranks)

    def look_at_peer(self, address: str) -> Sighting:
        """Who answers at ``address``'s side channel now (``kvpush.peers.sighting``): the
        evidence a registry hint is checked against. Any thread; bounded (a few seconds)."""
        host, port = parse_address(address)
        return look(host, port, self.auth, self.cfg.engine_id)

    def forget_peer(self, address: str, incarnation: str | None, reason: str, why: str) -> None:
        """From any thread: the peer endpoint at ``address`` (of ``incarnation``) is proven gone
        (``reason`` ``peer_left``: its side channel refused) or replaced (``peer_restarted``:
        another incarnation answers there); ``why`` says the evidence. Never call this on a
        registry event alone (a hint: ``kvpush.fleet.member``). Every rank drops its
        connections to it at once, on its owner thread: the peer's NIXL agent and descriptors
        are released, and the work in flight with it fails with ``reason``. With an
        incarnation, connections are matched by it (whatever address they were reached by);
        without one, by address."""
        host, port = parse_address(address)
        fail = Failure.parse(reason) or Failure.PEER_LEFT
        detail = f"{address} {'restarted' if fail == Failure.PEER_RESTARTED else 'is gone'}"
        if incarnation:
            detail += f" (incarnation {incarnation[:12]})"
        gone = PeerGone(host, port, incarnation, fail, f"{detail}: {why}")
        for rk in self.ranks:
            rk.role.forget_peer(gone)

    def warm_peer(self, address: str, tp_size: int, engine_id: str) -> list[Warm]:
        """``--prewarm``: from every rank, start (or find) the connections a request with the
        peer endpoint of the other role at ``address`` (``tp_size`` ranks, engine
        ``engine_id``) would use (``kvpush.peers.warm``). Any thread; never waits."""
        host, port = parse_address(address)
        return [
            w
            for rk in self.ranks
            for w in warm(rk.handshakes, rk.cfg, host, port, tp_size, engine_id)
        ]

    def publish_nixl_metadata(self) -> None:
        """``--nixl-metadata etcd``: publish every rank's agent metadata again (after the
        registry came back: NIXL does not retry a publish that found etcd down)."""
        for rk in self.ranks:
            if rk.agent.etcd_metadata:
                try:
                    rk.agent.publish()
                except KvpushError as e:
                    log.warning("publishing %s's NIXL metadata failed: %s", rk.agent_name, e)

    def failure(self) -> BaseException | None:
        """The first failure of the side channel's or a rank's threads (the rank named)."""
        if self.server.failure is not None:
            return self.server.failure
        for rk in self.ranks:
            f = rk.role.failure()
            if f is not None:
                return f if len(self.ranks) == 1 else RankFailure(rk.rank, f)
        return None

    def snapshot(self) -> Snapshot:
        """The endpoint's telemetry: one rank's, or every rank's merged (each kept under
        ``ranks``)."""
        snaps = [rk.telemetry.snapshot() for rk in self.ranks]
        if len(snaps) == 1:
            return snaps[0]
        top = self._group_tm.snapshot() if self._group_tm is not None else None
        return merge(snaps, top)

    # ------------------------------------------------------------------ side channel
    def _handle_request(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        if not self._ready.is_set():
            _refuse(reply, req, "not_ready", "starting", "retry shortly")
            return
        if isinstance(req, protocol.StatsReq):
            reply(protocol.StatsRep(rid=req.rid, snapshot=self.snapshot().to_dict()))
            return
        if isinstance(req, protocol.HandshakeReq):
            self._reply_handshake(req, reply)
            return
        # Draining: no new work; a peer's decline still ends work this endpoint holds (until
        # the roles stop: then they have ended it all).
        if self._closing.is_set() or (
            self._stopping.is_set() and not isinstance(req, protocol.DeclineReq)
        ):
            self._refuse_stopping(req, reply)
            return
        role = self.cfg.role
        if not self.group.handle(req, reply):
            what = f"a {role} endpoint does not serve {type(req).__name__}"
            hint = "send prefill requests to P and decode requests to D"
            _refuse(reply, req, "unsupported", what, hint)

    def _reply_handshake(self, req: protocol.HandshakeReq, reply: ReplyFn) -> None:
        refusal = answers.refuse_handshake(self.dialect, self.cfg.tp_size, req)
        if refusal is not None:
            reply(refusal)
            return
        rk = self.ranks[req.tp_rank]
        agent_md = rk.agent_md_full if req.mode == "full" else rk.agent_md_conn
        rep = protocol.HandshakeRep(
            rid=req.rid,
            compat_hash=protocol.compat_hash(rk.metadata),
            metadata=rk.md_bytes,
            agent_metadata=agent_md,
            server_clock=0.0,
        )

        def send() -> None:
            import msgspec

            with self._gate:
                if self._closing.is_set():
                    self._refuse_stopping(req, reply)
                    return
                rk.telemetry.inc(Counter.HANDSHAKES_SERVED)
                reply(msgspec.structs.replace(rep, server_clock=time.time()))

        delay = self.instruments.handshake_reply_delay_s
        if delay > 0:
            t = threading.Timer(delay, send)
            t.daemon = True
            t.start()
        else:
            send()

    def _refuse_stopping(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        what = f"{self.cfg.role} endpoint is shutting down"
        _refuse(reply, req, "shutting_down", what, "send it to another endpoint")

    def _answer_get_meta(self, pp_rank: int, tp_rank: int) -> list[bytes]:
        """Answer vLLM's ``get_meta_msg`` (every client's first contact) in vLLM's form."""
        ready = self._ready.is_set()
        rk = self.ranks[tp_rank] if ready and 0 <= tp_rank < len(self.ranks) else None
        md = (rk or self.ranks[0]).metadata if ready else None
        with self._gate:  # once the roles stop, no answer carries metadata to load
            payload = answers.get_meta_payload(
                md,
                self.dialect,
                self.auth.enabled,
                rk.agent_md_full if rk is not None else b"",
                (pp_rank, tp_rank),
                stopping=self._stopping.is_set(),
                closed=self._closing.is_set(),
            )
            return vllm.encode_get_meta_reply(payload, time.perf_counter())

    # ------------------------------------------------------------------ probes
    def handshake_to(self, address: str, mode: HandshakeMode, rank: int = 0) -> PeerConn:
        """A real NIXL handshake from rank 0 to ``rank`` of another endpoint (used by
        ``kvpush probe --handshake``)."""
        host, port = parse_address(address)
        key = (host, port, rank)
        t = self.cfg.timeouts.handshake_s + 1
        try:
            return self.handshakes.handshake_sync(key, mode, t)
        except TimeoutError:
            raise PeerUnreachableError(
                f"handshake with {address} did not finish in {t:g}s"
            ) from None

    def ping(self, address: str, count: int, rank: int = 0) -> list[float]:
        """NIXL notification round trips from rank 0 to ``rank`` of the endpoint at
        ``address`` (the first, warm-up trip excluded)."""
        conn = self.handshake_to(address, HandshakeMode.NOTIF, rank)
        rk = self.ranks[0]
        return rk.pinger.ping(conn, count, rk.role.poke)


class RankFailure(RuntimeError):
    """A rank's owner thread failed (the other ranks serve on)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank}: {error!r}")
        self.rank = rank
        self.error = error


def _refuse(reply: ReplyFn, req: protocol.SideRequest, code: str, message: str, hint: str) -> None:
    """Answer a side-channel request with an error (the endpoint's own refusals)."""
    reply(protocol.ErrorRep(rid=req.rid, code=code, message=message, hint=hint))
