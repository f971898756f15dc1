"""Probing a peer's side channel: metadata, RTT, clock offset, compatibility, optional handshake.

Owns the entry point behind ``kvpush probe``: first contact, identification and the rank check,
after which the peer is measured by ``kvpush.commands.probe.kvpush_peer`` (a kvpush endpoint on its
own wire) or ``kvpush.commands.probe.vllm_peer`` (anything on vLLM's wire); returns a
``ProbeReport`` (``kvpush.commands.probe.report``) and raises typed errors (``PeerUnreachableError``
when nothing answers). Runs on the caller's thread; every side-channel client it makes is used and
closed on that thread. The default probe needs no NIXL: it only speaks the side channel
(``HandshakeReq`` in notif mode never loads anything). The ``handshake_probe`` variant starts a tiny
local decode endpoint to time a real NIXL handshake.

Safe first contact: the first message to any peer is vLLM's own request form
``msgpack((b"get_meta_msg", pp_rank, tp_rank))``, the one request vLLM's listener survives. A
kvpush endpoint answers it with its identity under an extra key; a vLLM engine's answer is
decoded with kvpush's bounded, typed decoders (the compatibility hash first, then
``NixlAgentMetadata``) and it is sent nothing else. The agent metadata bytes are reported by
size only and never handed to NIXL.

Ranks: a kvpush peer's identity lists every (pp, tp) rank it serves and its ``tp_size``
(``served_ranks`` reads it as "0..N-1"). A rank other than 0,0 is asked for only when it is
known to be served, and then everything the probe does -- the metadata, the handshake, the
pings -- is with that rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from kvpush.address import format_address, parse_address
from kvpush.commands.common import control
from kvpush.commands.probe import kvpush_peer as probe_kvpush
from kvpush.commands.probe import vllm_peer as probe_vllm
from kvpush.commands.probe.report import ProbeReport, served_ranks
from kvpush.config import EndpointConfig, HandshakeMode, require_counts
from kvpush.errors import ConfigError, PeerError, PeerUnreachableError, ProtocolError
from kvpush.transport.versions import Versions, local_versions, warnings_for
from kvpush.wire import protocol

if TYPE_CHECKING:
    from kvpush.transport.client import PeerIdentity, SideChannelClient

UNREACHABLE_HINT = control.UNREACHABLE_HINT


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
    require_counts(("--count", count))
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
                report = probe_vllm.measure(addr, client, ident, count, local)
                if kv is not None and stats and not kv.auth:
                    report = _with_stats(report, client)
                return report
            return _with_versions(
                probe_kvpush.measure(addr, client, ident, count, local, stats, ranks[1])
            )
        except PeerUnreachableError as e:
            raise PeerUnreachableError(e.message, UNREACHABLE_HINT) from None


def _check_rank(
    addr: str, ident: PeerIdentity, ranks: tuple[int, int], peer_tp: int | None
) -> None:
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


def _with_versions(report: ProbeReport) -> ProbeReport:
    """Both sides' NIXL/UCX versions, and the known issues of either (``transport.versions``)."""
    mine = local_versions()
    md = report.metadata
    theirs = Versions(nixl=str(md.get("nixl_version") or ""), ucx=str(md.get("ucx_version") or ""))
    warns = [f"peer: {w}" for w in warnings_for(theirs)]
    warns += [f"this host: {w}" for w in warnings_for(mine)]
    return replace(report, local_versions=asdict(mine), version_warnings=warns)


def _with_stats(report: ProbeReport, client: SideChannelClient) -> ProbeReport:
    s = client.request(protocol.StatsReq())
    if not isinstance(s, protocol.StatsRep):
        raise PeerError(f"{report.address} answered a stats request with {type(s).__name__}")
    return replace(report, stats=dict(s.snapshot))


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
    from kvpush.endpoint import open_endpoint

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
