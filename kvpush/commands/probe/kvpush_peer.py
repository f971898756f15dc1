"""Probing a kvpush endpoint's side channel: its metadata, RTT, clock offset and compatibility.

Owns what ``kvpush probe`` does once a peer said (in its answer to vLLM's ``get_meta_msg``) that
it is a kvpush endpoint on kvpush's own wire: ``count`` notif-only ``HandshakeReq`` round trips
(which load nothing), the optional ``StatsReq``, the decoding of its metadata with kvpush's
bounded decoders (loosely, to name what differs, when it is another version's) and the
comparison of its compatibility fields; and the probe's own tiny decode endpoint for a
handshake with it (``tiny_local_config``). Runs on the caller's thread, on the client that
``kvpush.commands.probe.probe.probe`` opened there.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec

from kvpush import PROTOCOL_VERSION
from kvpush.commands.common import control
from kvpush.commands.probe.report import ProbeReport, answered
from kvpush.config import EndpointConfig, KvRegions, PoolConfig, Role
from kvpush.errors import IncompatiblePeerError, PeerError, PeerShuttingDownError, ProtocolError
from kvpush.wire import protocol

if TYPE_CHECKING:
    from kvpush.transport.client import PeerIdentity, SideChannelClient
    from kvpush.wire.vllm import KvpushIdentity

# kvpush endpoints stamp HandshakeRep.server_clock with time.time() (wall clock, comparable
# across hosts); vLLM stamps its get_meta_msg answer with time.perf_counter().
_KVPUSH_CLOCK = time.time


#: What probe says of a peer whose first-contact answer says it drains (it still serves).
DRAINING = "shutting down: it drains the work it holds and takes no new work"


def stopped(addr: str) -> PeerShuttingDownError:
    """A peer whose first-contact answer says its roles have stopped (``stopping`` and an
    error, no metadata): it serves nothing more, and its side channel closes next."""
    return PeerShuttingDownError(
        f"{addr} is a kvpush endpoint that is shutting down: it serves nothing more",
        "probe it again once it has restarted, or probe another endpoint",
    )


def _check_serving(addr: str, kv: KvpushIdentity) -> None:
    """Raise what probe says of a kvpush endpoint whose first answer says it serves nothing."""
    if kv.shut_down:
        raise stopped(addr)
    if kv.error == "starting":
        raise PeerError(f"{addr} is a kvpush endpoint: starting", "probe it again in a moment")
    if kv.error:
        raise PeerError(f"{addr} is a kvpush endpoint: {kv.error}", "ask for rank 0,0")


def _incompatible_protocol(address: str, e: ProtocolError) -> IncompatiblePeerError:
    return IncompatiblePeerError(
        f"{address} answered, but its reply cannot be read: {e}",
        [("protocol_version", PROTOCOL_VERSION, "?")],
        "run the same kvpush version on both sides",
    )


def _handshakes(
    addr: str, client: SideChannelClient, req: protocol.HandshakeReq, count: int
) -> tuple[list[tuple[float, float, float]], protocol.HandshakeRep | None]:
    """``count`` handshakes: the (sent, received, server clock) of each, and the last reply."""
    samples: list[tuple[float, float, float]] = []
    rep: protocol.HandshakeRep | None = None
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
    return samples, rep


def measure(
    addr: str,
    client: SideChannelClient,
    ident: PeerIdentity,
    count: int,
    local: dict[str, object] | None,
    want_stats: bool,
    tp_rank: int = 0,
) -> ProbeReport:
    kv = ident.kvpush
    if kv is None:  # the caller measures only a peer that said it is a kvpush endpoint
        raise PeerError(f"{addr} is not a kvpush endpoint")
    _check_serving(addr, kv)
    req = protocol.HandshakeReq(mode="notif", requester="kvpush-probe", tp_rank=tp_rank)
    samples, rep = _handshakes(addr, client, req, count)
    stats_d: dict[str, object] | None = None
    if want_stats:
        s = control.call(client, protocol.StatsReq())
        if not isinstance(s, protocol.StatsRep):
            raise PeerError(f"{addr} answered a stats request with {type(s).__name__}")
        stats_d = dict(s.snapshot)
    assert rep is not None
    try:
        md = protocol.decode_metadata(rep.metadata)
        meta: dict[str, object] = msgspec.structs.asdict(md)
    except ProtocolError:
        # Not our schema (another version): decode loosely only to name what differs.
        meta = protocol.decode_metadata_loose(rep.metadata)
    meta.pop("region_base_addrs", None)
    if meta.get("tp_rank", tp_rank) != tp_rank:
        raise PeerError(f"{addr} was asked for rank {tp_rank} and described rank {meta['tp_rank']}")
    meta["wire"] = kv.wire
    meta["ranks"] = [list(r) for r in kv.ranks]
    tp_size = meta.get("tp_size")
    if not meta["ranks"] and isinstance(tp_size, int) and tp_size > 0:
        # With a token the unauthenticated first answer lists no ranks (only that a token is
        # needed); the authenticated metadata says the TP size: a kvpush endpoint serves
        # pipeline rank 0, tensor ranks 0..tp-1 (``endpoint.answers``).
        meta["ranks"] = [[0, r] for r in range(tp_size)]
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
    notes = [DRAINING] if kv.stopping else []
    return answered(
        addr, "kvpush", rep.compat_hash, meta, samples, local, diffs, stats=stats_d, notes=notes
    )


def _count(value: object, default: int) -> int:
    """A count of the peer's metadata (``int(value or default)``; a value no count can be read
    from reads as ``default``)."""
    return int(value) if isinstance(value, int | float | str) and value else default


def tiny_local_config(
    remote: dict[str, object], given: PoolConfig | None, token: bytes | None, base: EndpointConfig
) -> EndpointConfig:
    """The probe's own decode endpoint: the peer's geometry (or the given one), 4 blocks, one
    rank -- so its page is the model's page (every rank's share of a TP peer together), as the
    compatibility check compares it."""
    if given is not None:
        pool = replace(given, num_blocks=4, tp_size=1)
    else:
        layers = _count(remote.get("layers"), 1)
        kv_heads = _count(remote.get("kv_heads"), 1)
        tp_size = _count(remote.get("tp_size"), 1)
        block_bytes = _count(remote.get("block_bytes"), 4096)
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
        role=Role.DECODE,
        host=base.host,
        port=0,
        engine_id=base.engine_id,
        pool=pool,
        agent=base.agent,
        timeouts=base.timeouts,
        auth_token=token,
    )
