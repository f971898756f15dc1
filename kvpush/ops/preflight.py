"""Drive's preflight: every endpoint answers, has the role it was given as, and P and D match.

Owns ``check_peers``: before the first request, each P and D is looked at over raw TCP
(``control.first_contact``: a closed port is "connection refused" at once, an HTTP server is
named as such), then asked for its metadata; a wrong role, a ``--blocks`` larger than a pool, or
a D whose geometry differs from P's (dtype, layout, block size, layers) is refused with the
fields that differ, before any request could fail for it. Runs on the caller's thread; each
client is closed before it returns.
"""

from __future__ import annotations

from typing import Any

from kvpush.config import Role
from kvpush.errors import ConfigError, IncompatiblePeerError, PeerError, PeerUnreachableError
from kvpush.ops import control
from kvpush.ops.results import DriveConfig
from kvpush.wire import protocol

PREFLIGHT_TIMEOUT_S = 5.0
MIN_CONTACT_S = 1.0


def peer_metadata(address: str, token: bytes | None, timeout_s: float) -> dict[str, Any]:
    """The endpoint metadata of a kvpush peer (raises the typed error of what it found)."""
    control.first_contact(address, timeout_s)
    with control.connect(address, token, timeout_s) as c:
        rep = control.call(c, protocol.HandshakeReq(mode="notif", requester="kvpush-drive"))
    if not isinstance(rep, protocol.HandshakeRep):
        raise PeerError(f"{address} answered a handshake request with {type(rep).__name__}")
    return protocol.decode_metadata_loose(rep.metadata)


def check_peers(
    cfg: DriveConfig, timeout_s: float = PREFLIGHT_TIMEOUT_S
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Fail fast, in this order: reachability, roles, pool sizes, P/D compatibility.

    Returns the metadata of every peer that answered (what a peer that was down must match
    again: ``kvpush.ops.readmit``) and the peers unreachable at start (address -> what was
    found). A peer that is unreachable at start does not stop the run while another peer of
    its role is up: the run starts with it down, as if it had died a moment before. With no P
    or no D up, the first such error is raised (exit 69). The checks below apply to the peers
    that answered."""
    # A short --timeout bounds each request, not the first contact: below a second a live
    # peer's connection set-up alone could exceed it, and it would be reported unreachable.
    wait = min(timeout_s, max(cfg.timeout_s, MIN_CONTACT_S))
    meta, down = _contact(cfg, wait)
    up = [a for a in (*cfg.prefill, *cfg.decode) if a in meta]
    _check_pools(cfg, meta, up)
    ref = next(a for a in cfg.prefill if a in meta)
    _check_compat(meta, up, ref)
    if cfg.shape:
        _check_shape(cfg.shape, ref, meta[ref])
    _check_tp(cfg, meta)
    return meta, down


def _contact(cfg: DriveConfig, wait: float) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every peer's metadata (by address) and the peers that are down (address -> why); a
    peer of the wrong role, or a role with no peer up, is an error."""
    meta: dict[str, dict[str, Any]] = {}
    down: dict[str, str] = {}
    for role, addrs in ((Role.PREFILL, cfg.prefill), (Role.DECODE, cfg.decode)):
        first: PeerUnreachableError | None = None
        for addr in addrs:
            try:
                md = meta[addr] = peer_metadata(addr, cfg.auth_token, wait)
            except PeerUnreachableError as e:
                down[addr] = e.message
                first = first or e
                continue
            if md.get("role") != role:
                flag = "--prefill" if role == Role.PREFILL else "--decode"
                raise ConfigError(
                    f"{addr} is a {md.get('role')} endpoint, not {role}",
                    f"give {flag} only {role} endpoints",
                )
        if first is not None and all(a in down for a in addrs):
            raise first
    return meta, down


def _check_pools(cfg: DriveConfig, meta: dict[str, dict[str, Any]], up: list[str]) -> None:
    """``--blocks`` fits the pool of every peer that is up."""
    for addr in up:
        pool = meta[addr].get("num_blocks")
        if isinstance(pool, int) and cfg.blocks > pool:
            raise ConfigError(
                f"--blocks {cfg.blocks} exceeds the pool of {addr} ({pool} blocks)",
                f"use --blocks {pool} or fewer",
            )


def _check_compat(meta: dict[str, dict[str, Any]], up: list[str], ref: str) -> None:
    """Every peer that is up has the geometry of ``ref``, the first prefill peer up."""
    # The model's page (every rank's share together) is what P and D share, whatever their TP.
    ref_fields = protocol.compat_fields_loose(meta[ref])
    for addr in up:
        if addr == ref:
            continue
        remote = protocol.compat_fields_loose(meta[addr])
        diffs = protocol.compat_differences(ref_fields, remote)
        if diffs:
            kind = meta[addr].get("role")
            named = ", ".join(f"{f} {theirs} vs {ours}" for f, ours, theirs in diffs)
            raise IncompatiblePeerError(
                f"{addr} ({kind}) is incompatible with {ref} (prefill): {named}",
                diffs,
                "P and D must agree on dtype, kv layout, block size and layers: start them "
                "with the same geometry options",
            )


def _check_tp(cfg: DriveConfig, meta: dict[str, dict[str, Any]]) -> None:
    """Each pair of P and D up has TP sizes of which one divides the other."""
    for p_addr in (a for a in cfg.prefill if a in meta):
        for d_addr in (a for a in cfg.decode if a in meta):
            p_tp, d_tp = meta[p_addr].get("tp_size", 1), meta[d_addr].get("tp_size", 1)
            if isinstance(p_tp, int) and isinstance(d_tp, int) and p_tp % d_tp and d_tp % p_tp:
                raise IncompatiblePeerError(
                    f"{d_addr} (decode, tp {d_tp}) cannot draw from {p_addr} (prefill, tp "
                    f"{p_tp}): P has {p_tp} ranks, D has {d_tp}; one must divide the other",
                    [("tp_size", p_tp, d_tp)],
                    "run P and D at TP sizes that divide one another (e.g. 8 and 4)",
                )


def _check_shape(name: str, address: str, md: dict[str, Any]) -> None:
    """``--shape``: P serves that model's geometry (its whole page, every rank together)."""
    from kvpush.memory.shapes import get_shape

    shape = get_shape(name)
    want = {
        "layers": shape.layers,
        "regions": shape.regions,
        "block_bytes": shape.page_bytes,
        "dtype": shape.dtype,
    }
    have = protocol.compat_fields_loose(md)
    diffs = [(f, v, have.get(f)) for f, v in want.items() if have.get(f) != v]
    if diffs:
        named = ", ".join(f"{f} {theirs} vs {ours}" for f, ours, theirs in diffs)
        raise IncompatiblePeerError(
            f"{address} (prefill) is not shape {name}: {named}",
            diffs,
            f"start the endpoints with {shape.name}'s geometry ({shape.describe()}), or drop "
            "--shape",
        )
