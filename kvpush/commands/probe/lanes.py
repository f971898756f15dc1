"""``kvpush probe --lanes PEER``: which lane carries KV between this host and a kvpush peer.

A lane is only known once UCX has chosen it for a real WRITE, so the probe makes a few pushes
the way ``drive`` does its two legs, with a tiny endpoint of its own (one rank, the peer's
geometry, lanes on):

- a kvpush **D**: the probe runs a tiny P in this process, asks it to fill ``pushes`` transfers
  of ``blocks`` blocks and sends D the decode leg of each (D allocates, handshakes with the
  tiny P, registers, is written, verifies the bytes); the lane is the tiny P's own
  (``kvpush.transport.lanes``: UCX's protocol report, read from its private log file);
- a kvpush **P**: the probe's tiny D asks P for the same pushes (P's prefill leg over the side
  channel, the decode leg on the tiny D) and then asks P (``StatsReq``) for the lane of its row
  for the tiny D: P's view, from P's own UCX report (P must run with lanes on, the default).

A vLLM engine is refused before anything is sent: a lane needs a push, and only a vLLM router
can start a vLLM engine's push (kvpush never sends a vLLM listener anything but the safe
probe's ``get_meta_msg``).

The tiny endpoint binds the address this host reaches the peer from (loopback for a loopback
peer), so that the peer can connect back to it. Runs on the caller's thread; the endpoint's
own threads stop before it returns.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import uuid
from collections.abc import Mapping
from dataclasses import replace

from kvpush.address import parse_address
from kvpush.commands.common import control
from kvpush.commands.probe.report import LaneRow
from kvpush.config import EndpointConfig, Role
from kvpush.errors import ConfigError, PeerError
from kvpush.wire import protocol

#: Pushes a lane probe makes, and blocks per push.
PUSHES = 3
BLOCKS = 2


def refuse_vllm(address: str) -> ConfigError:
    return ConfigError(
        f"no lanes for {address}: a lane shows once a push runs, and kvpush cannot start a "
        "vLLM engine's push (only its router can); it was sent nothing but the safe probe",
        "probe a kvpush endpoint with --lanes, or run 'kvpush fleet check' with a kvpush "
        "endpoint beside the vLLM engines",
    )


def local_host_for(peer_host: str) -> str:
    """The address of this host that ``peer_host`` is reached from (it connects back to it)."""
    try:
        if ipaddress.ip_address(peer_host).is_loopback:
            return "::1" if ":" in peer_host else "127.0.0.1"
    except ValueError:
        if peer_host == "localhost":
            return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, 9))  # UDP: no packet is sent, the route is looked up
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def lane_probe(
    address: str, role: str, local: EndpointConfig, token: bytes | None, timeout_s: float
) -> list[LaneRow]:
    """The lane rows of ``pushes`` real pushes with the kvpush peer at ``address`` of ``role``
    (``local``: the tiny endpoint's config, from the peer's geometry); raises typed errors."""
    host, _ = parse_address(address)
    cfg = replace(
        local,
        host=local_host_for(host),
        port=0,
        agent=replace(local.agent, lanes=True),
        pool=replace(local.pool, num_blocks=max(local.pool.num_blocks, 2 * BLOCKS)),
    )
    if role == Role.DECODE:
        return _into_decode(address, replace(cfg, role=Role.PREFILL), token, timeout_s)
    if role == Role.PREFILL:
        return _from_prefill(address, replace(cfg, role=Role.DECODE), token, timeout_s)
    raise PeerError(f"{address} says it is a {role!r}: lanes need a prefill or decode endpoint")


def _into_decode(
    address: str, cfg: EndpointConfig, token: bytes | None, timeout_s: float
) -> list[LaneRow]:
    """A tiny P in this process writes into D; its own rows say the lane."""
    from kvpush.endpoint import open_endpoint

    ep = open_endpoint(cfg)
    try:
        ph, pp = parse_address(ep.address)
        with contextlib.closing(control.connect(address, token, timeout_s)) as client:
            for tid in _tids():
                ep.prefill(tid, BLOCKS)
                req = protocol.DecodeReq(
                    transfer_id=tid,
                    prefill_host=ph,
                    prefill_port=pp,
                    num_blocks=BLOCKS,
                    deadline_s=timeout_s,
                )
                _check(address, control.call(client, req, timeout_s + 5.0), tid)
        rows = [r for r in ep.snapshot().peers if isinstance(r.get("lane"), dict)]
    finally:
        ep.stop()
    return [_side(r, "this probe's P, writing into the peer") for r in rows]


def _from_prefill(
    address: str, cfg: EndpointConfig, token: bytes | None, timeout_s: float
) -> list[LaneRow]:
    """P writes into a tiny D of this process; P's row for it says the lane."""
    from kvpush.endpoint import open_endpoint

    ep = open_endpoint(cfg)
    try:
        mine = ep.address
        with contextlib.closing(control.connect(address, token, timeout_s)) as client:
            for tid in _tids():
                rep = control.call(
                    client, protocol.PrefillReq(transfer_id=tid, num_blocks=BLOCKS), timeout_s
                )
                if not isinstance(rep, protocol.PrefillRep) or rep.outcome != "ok":
                    why = getattr(rep, "reason", type(rep).__name__)
                    raise PeerError(f"{address} refused the prefill of a lane probe: {why}")
                _check(address, ep.decode(tid, address, BLOCKS, timeout_s).result(), tid)
            stats = control.call(client, protocol.StatsReq(), timeout_s)
    finally:
        ep.stop()
    if not isinstance(stats, protocol.StatsRep):
        raise PeerError(f"{address} answered a stats request with {type(stats).__name__}")
    rows = lane_rows(stats.snapshot, mine)
    if not rows:
        raise PeerError(
            f"{address} reports no row for this probe's decode endpoint {mine}",
            "is it an older kvpush? its peer rows carry no lanes",
        )
    return [_side(r, "the peer P, writing into this probe's D") for r in rows]


def lane_rows(snapshot: Mapping[str, object], address: str) -> list[dict[str, object]]:
    """A P's peer rows (its ``StatsReq`` reply's ``snapshot``, or an ``-o json`` line) for the
    D whose side channel is ``address`` (``HOST:PORT`` as D announces it): one per D rank
    (``HOST:PORT`` for rank 0, ``HOST:PORT rank R``) and, at P's TP > 1, per P rank (``rank``).
    Each carries ``lane`` (a dict: ``write``, ``devices``, ``notif``, ``notif_devices``,
    ``locality``, ``cfg``, ``evidence``, ``pushes``, ``descs_per_push``, ``descs_mean``,
    ``post_us_mean``, ``post_us_per_desc``, ``post_share``...) and ``lane_flags`` once P has
    written to it; rows without a lane (no WRITE yet, an older kvpush) are left out."""
    peers = snapshot.get("peers")
    rows = [r for r in peers if isinstance(r, dict)] if isinstance(peers, list) else []
    return [
        r
        for r in rows
        if isinstance(r.get("lane"), dict)
        and (str(r.get("peer")) == address or str(r.get("peer")).startswith(f"{address} rank "))
    ]


def lane_word(row: Mapping[str, object]) -> str:
    """A lane row in a few characters, for a matrix cell: ``cma``, ``tcp!tcp_on_one_host``,
    ``ambiguous``, ``?``."""
    lane = row.get("lane")
    if not isinstance(lane, dict):
        return "?"
    write = lane.get("write")
    evidence = str(lane.get("evidence") or "")
    word = "+".join(str(w) for w in write) if isinstance(write, list) and write else ""
    word = word or ("ambiguous" if evidence.startswith("ambiguous") else "?")
    flags = row.get("lane_flags")
    return f"{word}!{','.join(flags)}" if isinstance(flags, list) and flags else word


def _tids() -> list[str]:
    run = uuid.uuid4().hex[:12]
    return [f"lanes-{run}-{i}" for i in range(PUSHES)]


def _check(address: str, rep: object, tid: str) -> None:
    """A push of the probe must have ended well and verified."""
    if not isinstance(rep, protocol.DecodeRep):
        raise PeerError(f"{address}: the lane probe's push {tid} got {type(rep).__name__}")
    if rep.outcome != "ok":
        raise PeerError(
            f"the lane probe's push {tid} with {address} failed: {rep.reason}: {rep.detail}"
        )
    if rep.verified is False:
        raise PeerError(f"the lane probe's push {tid} with {address} landed wrong bytes")


def _side(row: Mapping[str, object], writer: str) -> LaneRow:
    got = row.get("lane")
    flags = row.get("lane_flags")
    lane: dict[str, object] = (
        got
        if isinstance(got, dict)
        else {"evidence": "unknown: the peer reports no lane (lanes off, or an older kvpush)"}
    )
    return {
        "peer": row.get("peer"),
        "writer": writer,
        "lane": lane,
        "lane_flags": list(flags) if isinstance(flags, list) else [],
    }


__all__ = [
    "BLOCKS",
    "PUSHES",
    "lane_probe",
    "lane_rows",
    "lane_word",
    "local_host_for",
    "refuse_vllm",
]
