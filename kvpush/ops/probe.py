"""Probing a peer's side channel: metadata, RTT, clock offset, compatibility, optional handshake.

Owns the logic behind ``kvpush probe``; returns a ``ProbeReport`` dataclass and raises typed
errors (``PeerUnreachableError`` when nothing answers). Runs on the caller's thread; every
side-channel client it makes is used and closed on that thread. The default probe needs no NIXL:
it only speaks the side channel (``HandshakeReq`` in notif mode never loads anything). The
``handshake_probe`` variant starts a tiny local decode endpoint to time a real NIXL handshake.

Safe first contact: the first message to any peer is vLLM's own request form
``msgpack((b"get_meta_msg", pp_rank, tp_rank))``, the one request vLLM's listener survives. A
kvpush endpoint answers it with its identity under an extra key; a vLLM engine's answer is
decoded with kvpush's bounded, typed decoders (the compatibility hash first, then
``NixlAgentMetadata``) and it is sent nothing else. The agent metadata bytes are reported by
size only and never handed to NIXL.

Ranks: a kvpush peer's identity lists every (pp, tp) rank it serves and its ``tp_size``
(``served_ranks`` reads it as "0..N-1"). Any other rank than 0,0 is asked for only when it is
known to be served, and then everything the probe does -- the metadata, the handshake, the
pings -- is with that rank.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import msgspec

from kvpush import PROTOCOL_VERSION
from kvpush.config import (
    EndpointConfig,
    HandshakeMode,
    KvRegions,
    PoolConfig,
    format_address,
    parse_address,
)
from kvpush.errors import (
    ConfigError,
    ExitStatus,
    IncompatiblePeerError,
    KvpushError,
    PeerError,
    PeerUnreachableError,
    ProtocolError,
)
from kvpush.ops import control
from kvpush.ops.like import likeness_of
from kvpush.ops.stats import median
from kvpush.wire import protocol, vllm

# kvpush endpoints stamp HandshakeRep.server_clock with time.time() (wall clock, comparable
# across hosts); vLLM stamps its get_meta_msg answer with time.perf_counter().
_KVPUSH_CLOCK = time.time


@dataclass(frozen=True)
class RttStats:
    """Side-channel round trips; the clock offset comes from the lowest-RTT sample."""

    samples_s: tuple[float, ...]
    clock_offset_s: float

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def median_s(self) -> float:
        return median(self.samples_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples_s),
            "min_s": self.min_s,
            "median_s": self.median_s,
            "clock_offset_s": self.clock_offset_s,
        }


def rtt_stats(samples: list[tuple[float, float, float]]) -> RttStats:
    """From ``(t_send, t_recv, remote_clock)`` samples: RTTs and the offset of the best one.

    offset = remote_clock - (t_send + t_recv) / 2, keeping the lowest-RTT sample (its midpoint
    is the tightest bound on when the peer read its clock).
    """
    if not samples:
        raise ValueError("no samples")
    best = min(samples, key=lambda s: s[1] - s[0])
    offset = best[2] - (best[0] + best[1]) / 2
    return RttStats(tuple(t1 - t0 for t0, t1, _ in samples), offset)


@dataclass(frozen=True)
class ProbeReport:
    address: str
    kind: Literal["kvpush", "vllm"]
    compat_hash: str
    metadata: dict[str, Any]
    rtt: RttStats
    compat_checked: bool = False
    differences: list[tuple[str, Any, Any]] = field(default_factory=list)
    handshake_mode: str | None = None
    handshake_timings_s: dict[str, float] | None = None
    ping_s: list[float] | None = None
    stats: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    suggest: list[str] = field(default_factory=list)  # kvpush command lines that fit the peer

    @property
    def compatible(self) -> bool | None:
        return (not self.differences) if self.compat_checked else None

    @property
    def exit_status(self) -> ExitStatus:
        return ExitStatus.NOT_READY if self.differences else ExitStatus.OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rtt"] = self.rtt.to_dict()
        d["differences"] = [
            {"field": f, "local": local, "remote": remote} for f, local, remote in self.differences
        ]
        d["compatible"] = self.compatible
        d["status"] = "healthy" if self.exit_status == ExitStatus.OK else "incompatible"
        d["exit_status"] = int(self.exit_status)
        return d


def local_compat_fields(pool: PoolConfig) -> dict[str, object]:
    """The compatibility fields (protocol.COMPAT_FIELDS) an endpoint with ``pool`` announces."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "dtype": pool.dtype,
        "kv_layout": pool.kv_layout,
        "block_bytes": pool.head_bytes * pool.kv_heads,  # the model's page, all ranks' shares
        "layers": pool.layers,
        "regions": pool.regions,
        "kv_heads": pool.kv_heads,
    }


UNREACHABLE_HINT = control.UNREACHABLE_HINT


def served_ranks(ranks: list[Any], tp_size: object = None) -> str:
    """A peer's ranks for a person: ``0..3 (tp 4)`` for pipeline rank 0 and tensor ranks
    0..N-1 (what kvpush serves), else every ``pp,tp`` pair."""
    pairs = [(int(r[0]), int(r[1])) for r in ranks]
    tp = f" (tp {tp_size})" if tp_size is not None else ""
    if pairs and pairs == [(0, t) for t in range(len(pairs))]:
        return (f"0..{len(pairs) - 1}" if len(pairs) > 1 else "0") + tp
    return (", ".join(f"{p},{t}" for p, t in pairs) or "none listed") + tp


def _incompatible_protocol(address: str, e: ProtocolError) -> IncompatiblePeerError:
    return IncompatiblePeerError(
        f"{address} answered, but its reply cannot be read: {e}",
        [("protocol_version", PROTOCOL_VERSION, "?")],
        "run the same kvpush version on both sides",
    )


def probe(
    address: str,
    *,
    count: int = 5,
    timeout_s: float = 3.0,
    local: dict[str, object] | None = None,
    token: bytes | None = None,
    ranks: tuple[int, int] = (0, 0),
    stats: bool = False,
    peer_tp: int | None = None,
) -> ProbeReport:
    """Identify a peer, fetch its metadata and measure ``count`` round trips.

    The first message is always vLLM's ``get_meta_msg`` for ``ranks`` (the one request vLLM's
    listener survives); a vLLM peer is then only ever sent more of those. A kvpush peer says
    so in its answer and gets kvpush's requests. ``local``: compatibility fields to compare
    against (``local_compat_fields``); None skips the comparison except for the protocol
    version.

    Rank (0, 0), which every engine serves, is always asked first. Another rank is asked only
    when it is known to be served: a kvpush peer lists its ranks; for a vLLM peer the caller
    must say its TP size (``peer_tp``), because vLLM 0.33's listener thread dies on a rank the
    engine does not serve and never answers again.
    """
    if count < 1:
        raise ConfigError(f"--count must be positive, got {count}", "pass --count 1 or more")
    host, port = parse_address(address)
    addr = format_address(host, port)
    control.first_contact(addr, timeout_s)
    with control.connect(addr, token, timeout_s) as client:
        try:
            ident = client.identify(0, 0)
            if ranks != (0, 0):
                _check_rank(addr, ident, ranks, peer_tp)
                ident = client.identify(*ranks)
        except PeerUnreachableError:
            raise control.UnreachablePeer(
                f"{addr}: timed out: a ZMQ socket accepted the connection but did not answer "
                f"get_meta_msg within {timeout_s:g}s (busy, frozen, or not a side channel)",
                "timeout",
                UNREACHABLE_HINT,
            ) from None
        except ProtocolError as e:
            raise control.NotASideChannel(e.message, "other", e.hint or None) from None
        try:
            kv = ident.kvpush
            if kv is None or kv.wire == "vllm":
                report = _probe_vllm(addr, client, ident, count, local)
                if kv is not None and stats and not kv.auth:
                    report = _with_stats(report, client)
                return report
            return _probe_kvpush(addr, client, ident, count, local, stats, ranks[1])
        except PeerUnreachableError as e:
            raise PeerUnreachableError(e.message, UNREACHABLE_HINT) from None


def _probe_kvpush(
    addr: str,
    client: Any,
    ident: Any,
    count: int,
    local: dict[str, object] | None,
    want_stats: bool,
    tp_rank: int = 0,
) -> ProbeReport:
    kv = ident.kvpush
    if kv.error:
        raise PeerError(f"{addr} is a kvpush endpoint: {kv.error}", "ask for rank 0,0")
    samples: list[tuple[float, float, float]] = []
    rep: protocol.HandshakeRep | None = None
    req = protocol.HandshakeReq(mode="notif", requester="kvpush-probe", tp_rank=tp_rank)
    for _ in range(count):
        t0 = _KVPUSH_CLOCK()
        try:
            r = control.call(client, req)
        except ProtocolError as e:
            raise _incompatible_protocol(addr, e) from None
        t1 = _KVPUSH_CLOCK()
        if not isinstance(r, protocol.HandshakeRep):
            raise PeerError(f"{addr} answered a handshake request with {type(r).__name__}")
        rep = r
        samples.append((t0, t1, r.server_clock))
    stats_d: dict[str, Any] | None = None
    if want_stats:
        s = control.call(client, protocol.StatsReq())
        if not isinstance(s, protocol.StatsRep):
            raise PeerError(f"{addr} answered a stats request with {type(s).__name__}")
        stats_d = dict(s.snapshot)
    assert rep is not None
    try:
        md = protocol.decode_metadata(rep.metadata)
        meta: dict[str, Any] = msgspec.structs.asdict(md)
    except ProtocolError:
        # Not our schema (another version): decode loosely only to name what differs.
        meta = protocol.decode_metadata_loose(rep.metadata)
    meta.pop("region_base_addrs", None)
    if meta.get("tp_rank", tp_rank) != tp_rank:
        raise PeerError(f"{addr} was asked for rank {tp_rank} and described rank {meta['tp_rank']}")
    meta["wire"] = kv.wire
    meta["ranks"] = [list(r) for r in kv.ranks]
    remote_fields = protocol.compat_fields_loose(meta)
    diffs: list[tuple[str, object, object]]
    if local is None:
        local_fields = {"protocol_version": PROTOCOL_VERSION}
        diffs = [
            (f, lv, remote_fields.get(f))
            for f, lv in local_fields.items()
            if remote_fields.get(f) != lv
        ]
    else:
        diffs = protocol.compat_differences(local, remote_fields)
    return ProbeReport(
        address=addr,
        kind="kvpush",
        compat_hash=rep.compat_hash,
        metadata=meta,
        rtt=rtt_stats(samples),
        compat_checked=local is not None,
        differences=diffs,
        stats=stats_d,
    )


def _check_rank(addr: str, ident: Any, ranks: tuple[int, int], peer_tp: int | None) -> None:
    """Refuse to ask a peer for a rank it may not serve (it would kill a vLLM listener)."""
    kv = ident.kvpush
    if kv is not None:
        served = [tuple(r) for r in kv.ranks]
        if served and ranks not in served:
            last = served[-1]
            raise PeerError(
                f"{addr} does not serve rank {ranks[0]},{ranks[1]}: it serves ranks "
                f"{served_ranks(list(served), kv.tp_size)}",
                f"ask for a rank it serves, e.g. --ranks {last[0]},{last[1]}",
            )
        return
    if ranks[0] != 0 or peer_tp is None or not 0 <= ranks[1] < peer_tp:
        raise ConfigError(
            f"not asking {addr} for rank {ranks[0]},{ranks[1]}: a vLLM 0.33 listener asked for "
            "a rank its engine does not serve dies and answers no handshake again",
            "pass --peer-tp N, the tp_size of its kv_transfer_params, to ask a rank below N "
            "(pipeline ranks other than 0 are not asked)",
        )


def _with_stats(report: ProbeReport, client: Any) -> ProbeReport:
    s = client.request(protocol.StatsReq())
    if not isinstance(s, protocol.StatsRep):
        raise PeerError(f"{report.address} answered a stats request with {type(s).__name__}")
    return replace(report, stats=dict(s.snapshot))


def vllm_differences(
    local: dict[str, object], md: vllm.AgentMetadata
) -> list[tuple[str, object, object]]:
    """What differs between a local geometry (``local_compat_fields``) and a vLLM peer's."""
    diffs: list[tuple[str, object, object]] = []
    regions = len(md.kv_caches_base_addr)
    if local.get("regions") != regions:
        diffs.append(("regions", local.get("regions"), regions))
    lens = sorted(set(md.block_lens))
    if [local.get("block_bytes")] != lens:
        diffs.append(("block_bytes", local.get("block_bytes"), lens[0] if len(lens) == 1 else lens))
    if local.get("kv_layout") != md.kv_cache_layout:
        diffs.append(("kv_layout", local.get("kv_layout"), md.kv_cache_layout))
    return diffs


def _probe_vllm(
    addr: str, client: Any, first: Any, count: int, local: dict[str, object] | None
) -> ProbeReport:
    """A vLLM side channel: only ever ``get_meta_msg`` on the one connection."""
    samples: list[tuple[float, float, float]] = []
    ident = first
    for _ in range(count):
        ident = client.identify(*first.ranks)
        samples.append((ident.t_send, ident.t_recv, ident.remote_clock))
    payload = ident.payload
    if not payload.agent_metadata_bytes:
        kv = payload.kvpush
        raise PeerError(
            f"{addr} answered rank {first.ranks[0]},{first.ranks[1]} without metadata"
            + (f": {kv.error}" if kv is not None and kv.error else ""),
            "ask for a rank it serves",
        )
    md = vllm.decode_agent_metadata(payload.agent_metadata_bytes)
    meta: dict[str, Any] = msgspec.structs.asdict(md)
    meta["agent_metadata_bytes"] = len(meta.pop("agent_metadata"))
    meta["regions"] = len(md.kv_caches_base_addr)
    meta["kv_caches_base_addr"] = [hex(a) for a in md.kv_caches_base_addr]
    meta["ranks"] = [list(first.ranks)]
    notes = [
        "vLLM side channel: only get_meta_msg was sent; the clock offset compares "
        "perf_counter clocks (meaningful on the same host only)"
    ]
    kv = payload.kvpush
    if kv is not None:
        meta["kvpush"] = msgspec.structs.asdict(kv)
        notes = [f"a kvpush endpoint ({kv.role}) speaking vLLM's push wire"]
    suggest: list[str] = []
    try:
        lk = likeness_of(payload, addr)
        suggest = [
            f"kvpush serve-decode --wire vllm --like {addr}   # receive its pushes",
            f"kvpush serve-prefill --wire vllm --like {addr}   # push into it",
            "kvpush " + " ".join(lk.options("decode")) + "   # the same, without the peer up",
        ]
    except KvpushError as e:
        notes.append(f"kvpush cannot stand in for it: {e.message}")
    diffs = vllm_differences(local, md) if local is not None else []
    if local is not None:
        notes.append("dtype is not in vLLM's metadata: it is part of the compatibility hash")
    return ProbeReport(
        address=addr,
        kind="vllm",
        compat_hash=payload.compatibility_hash,
        metadata=meta,
        rtt=rtt_stats(samples),
        compat_checked=local is not None,
        differences=diffs,
        notes=notes,
        suggest=suggest,
    )


@dataclass(frozen=True)
class HandshakeProbe:
    mode: str
    timings_s: dict[str, float]
    ping_s: list[float]


def handshake_probe(
    address: str,
    local: EndpointConfig,
    mode: HandshakeMode | None,
    ping_count: int = 0,
    rank: int = 0,
) -> HandshakeProbe:
    """Start a tiny local decode endpoint, do a real NIXL handshake (and pings) to ``address``'s
    tensor-parallel rank ``rank`` (the caller checked that the peer serves it).

    ``mode`` None with ``ping_count`` > 0 handshakes notif-only, which notifications need.
    """
    from kvpush.ops.engine import open_endpoint

    host, port = parse_address(address)
    addr = format_address(host, port)
    ep = open_endpoint(local)
    try:
        res = ep.handshake_to(addr, mode or HandshakeMode.NOTIF, rank)
        pings: list[float] = []
        if ping_count > 0:
            pings = ep.ping(addr, ping_count, rank)
        return HandshakeProbe(
            mode=(mode or HandshakeMode.NOTIF).value, timings_s=dict(res.timings), ping_s=pings
        )
    finally:
        ep.stop()


def tiny_vllm_config(address: str, base: EndpointConfig) -> EndpointConfig:
    """The probe's own endpoint for a vLLM peer: its geometry and hash (``--like``), 4 blocks,
    on vLLM's wire, so that the handshake passes the same checks a real deployment's would."""
    from kvpush.config import Wire
    from kvpush.ops.like import like

    lk = like(address, timeout_s=base.timeouts.side_channel_s)
    pool = PoolConfig(
        num_blocks=4,
        layers=lk.layers,
        block_bytes=lk.block_bytes,
        device=base.pool.device,
        dtype="uint8",
        kv_layout=lk.kv_layout,
        kv_regions=lk.kv_regions,
    )
    return EndpointConfig(
        role="decode",
        host=base.host,
        port=0,
        pool=pool,
        agent=base.agent,
        timeouts=base.timeouts,
        wire=Wire.VLLM,
        vllm=lk.wire,
    )


def tiny_local_config(
    remote: dict[str, Any], given: PoolConfig | None, token: bytes | None, base: EndpointConfig
) -> EndpointConfig:
    """The probe's own decode endpoint: the peer's geometry (or the given one), 4 blocks, one
    rank -- so its page is the model's page (every rank's share of a TP peer together), as the
    compatibility check compares it."""
    if given is not None:
        pool = replace(given, num_blocks=4, tp_size=1)
    else:
        layers = int(remote.get("layers") or 1)
        kv_heads = int(remote.get("kv_heads") or 1)
        tp_size = int(remote.get("tp_size") or 1)
        block_bytes = int(remote.get("block_bytes") or 4096)
        pool = PoolConfig(
            num_blocks=4,
            layers=layers,
            block_bytes=block_bytes * tp_size if kv_heads > 1 else block_bytes,
            device=base.pool.device,
            dtype=str(remote.get("dtype") or "bfloat16"),
            kv_layout=str(remote.get("kv_layout") or "NHD"),
            kv_regions=KvRegions.PER_LAYER if remote.get("regions") == layers else KvRegions.PER_KV,
            kv_heads=kv_heads,
        )
    return EndpointConfig(
        role="decode",
        host=base.host,
        port=0,
        engine_id=base.engine_id,
        pool=pool,
        agent=base.agent,
        timeouts=base.timeouts,
        auth_token=token,
    )
