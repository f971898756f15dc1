"""Drive's preflight: every endpoint answers, has the role it was given as, and P and D match.

Owns ``check_peers``: before the first request, each P and D is looked at over raw TCP
(``control.first_contact``: a closed port is "connection refused" at once, an HTTP server is
named as such), then asked for its metadata; a wrong role, a ``--blocks`` larger than a pool, or
a D whose geometry differs from P's (dtype, layout, block size, layers) is refused with the
fields that differ, before any request could fail for it.

Owns the two pieces every check of a peer is made of, wherever it runs: ``contact_all`` (the
metadata of many peers, ``CHECK_THREADS`` at a time, all of them within ``PREFLIGHT_BOUND_S``:
a silent peer costs its own wait, not everyone's) and ``misfit`` (pure: why a peer that answered
may not take a role's legs in this run -- role, pool, geometry against the run's reference P,
TP against the peers of the other role). ``kvpush.commands.drive.readmit`` (a peer that comes back)
and ``kvpush.commands.drive.targets`` (``drive --registry``'s records) use the same two.

Threads: ``check_peers`` and ``contact_all`` run on the caller's thread, which waits while
``contact_all``'s daemon threads (``drive-preflight-k``) contact the peers; each client is
closed before its thread moves on. ``misfit`` is pure.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvpush.commands.common import control
from kvpush.commands.common.results import DriveConfig
from kvpush.commands.drive.senders import Senders
from kvpush.config import Role
from kvpush.errors import (
    ConfigError,
    IncompatiblePeerError,
    KvpushError,
    PeerError,
    PeerUnreachableError,
)
from kvpush.wire import protocol

PREFLIGHT_TIMEOUT_S = 5.0
MIN_CONTACT_S = 1.0
#: Peers contacted at a time (each check holds one TCP look, then one side-channel client).
CHECK_THREADS = 16
#: All the peers of one ``contact_all`` answer within this, or count as not answering.
PREFLIGHT_BOUND_S = 20.0

#: What ``contact_all`` found at one address: its metadata, or the typed error of what it found.
Found = dict[str, object] | KvpushError


def peer_metadata(address: str, token: bytes | None, timeout_s: float) -> dict[str, object]:
    """The endpoint metadata of a kvpush peer (raises the typed error of what it found)."""
    control.first_contact(address, timeout_s)
    with control.connect(address, token, timeout_s) as c:
        rep = control.call(c, protocol.HandshakeReq(mode="notif", requester="kvpush-drive"))
    if not isinstance(rep, protocol.HandshakeRep):
        raise PeerError(f"{address} answered a handshake request with {type(rep).__name__}")
    return protocol.decode_metadata_loose(rep.metadata)


def contact_wait(cfg: DriveConfig, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> float:
    """How long one peer's first contact may take: ``timeout_s``, or a short ``--timeout``
    (which bounds each request, not the first contact) but never below ``MIN_CONTACT_S``: below
    a second a live peer's connection set-up alone could exceed it."""
    return min(timeout_s, max(cfg.timeout_s, MIN_CONTACT_S))


def contact_all(
    addresses: Iterable[str],
    token: bytes | None,
    wait_s: float,
    *,
    threads: int = CHECK_THREADS,
    bound_s: float = PREFLIGHT_BOUND_S,
) -> dict[str, Found]:
    """Every address's metadata (``peer_metadata``) or the error it raised, by address in the
    order given: ``threads`` peers at a time, all within ``bound_s`` -- a peer with no result by
    then is an ``UnreachablePeer`` (its thread, a daemon, ends on its own deadline)."""
    addrs = list(dict.fromkeys(addresses))
    found: dict[str, Found] = {}
    if not addrs:
        return found
    lock = threading.Lock()
    done = threading.Event()
    late = threading.Event()

    def one(address: str) -> None:
        if late.is_set():
            return
        try:
            got: Found = peer_metadata(address, token, wait_s)
        except KvpushError as e:
            got = e
        except Exception as e:  # a bug in one look must not hide the others' answers
            got = PeerError(f"{address}: {type(e).__name__}: {e}")
        with lock:
            found[address] = got
            if len(found) == len(addrs):
                done.set()

    pool = Senders(min(threads, len(addrs)), "drive-preflight")
    try:
        for a in addrs:
            pool.submit(one, a)
        done.wait(bound_s)
    finally:
        late.set()
        pool.close()
    with lock:
        got_all = dict(found)
    return {
        a: got_all.get(a)
        or control.UnreachablePeer(
            f"{a}: no answer within {bound_s:g}s (drive's preflight)",
            "timeout",
            control.UNREACHABLE_HINT,
        )
        for a in addrs
    }


def misfit(
    md: dict[str, object],
    role: str,
    blocks: int,
    ref: dict[str, object] | None = None,
    others: Iterable[dict[str, object]] = (),
) -> str:
    """Why a peer that answered with ``md`` may not take ``role``'s legs in this run ("" when
    it may): another role, a pool smaller than ``blocks``, a geometry (dtype, layout, the
    model's block size, layers, regions, KV heads) other than ``ref``'s -- the run's reference
    P --, or a TP size that neither divides nor is divided by that of a peer in ``others`` (the
    peers of the other role it would be paired with). Pure."""
    if md.get("role") != role:
        return f"it is a {md.get('role')} endpoint, not {role}"
    pool = md.get("num_blocks")
    if isinstance(pool, int) and blocks > pool:
        return f"its pool ({pool} blocks) is smaller than --blocks {blocks}"
    if ref is not None and ref is not md:
        diffs = protocol.compat_differences(
            protocol.compat_fields_loose(ref), protocol.compat_fields_loose(md)
        )
        if diffs:
            named = ", ".join(f"{f} {theirs} vs {ours}" for f, ours, theirs in diffs)
            return f"incompatible with the run's geometry: {named}"
    tp = md.get("tp_size", 1)
    for m in others:
        other = m.get("tp_size", 1)
        if isinstance(tp, int) and isinstance(other, int) and tp % other and other % tp:
            return f"its TP size {tp} and a {m.get('role')} peer's {other} do not divide"
    return ""


def check_peers(
    cfg: DriveConfig, timeout_s: float = PREFLIGHT_TIMEOUT_S
) -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Fail fast, in this order: reachability, roles, pool sizes, P/D compatibility.

    Returns the metadata of every peer that answered (what a peer that was down must match
    again: ``kvpush.commands.drive.readmit``) and the peers unreachable at start (address -> what
    was found). A peer that is unreachable at start does not stop the run while another peer of
    its role is up: the run starts with it down, as if it had died a moment before. With no P
    or no D up, the first such error is raised (exit 69). The checks below apply to the peers
    that answered."""
    meta, down = _contact(cfg, contact_wait(cfg, timeout_s))
    up = [a for a in (*cfg.prefill, *cfg.decode) if a in meta]
    _check_pools(cfg, meta, up)
    ref = next(a for a in cfg.prefill if a in meta)
    _check_compat(meta, up, ref)
    if cfg.shape:
        check_shape(cfg.shape, ref, meta[ref])
    _check_tp(cfg, meta)
    return meta, down


def _contact(cfg: DriveConfig, wait: float) -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Every peer's metadata (by address) and the peers that are down (address -> why); a
    peer of the wrong role, or a role with no peer up, is an error. The peers are contacted
    together (``contact_all``); what they answered is judged in the order given."""
    found = contact_all((*cfg.prefill, *cfg.decode), cfg.auth_token, wait)
    meta: dict[str, dict[str, object]] = {}
    down: dict[str, str] = {}
    for role, addrs in ((Role.PREFILL, cfg.prefill), (Role.DECODE, cfg.decode)):
        first: PeerUnreachableError | None = None
        for addr in addrs:
            got = found[addr]
            if isinstance(got, PeerUnreachableError):
                down[addr] = got.message
                first = first or got
                continue
            if isinstance(got, KvpushError):
                raise got
            md = meta[addr] = got
            if md.get("role") != role:
                flag = "--prefill" if role == Role.PREFILL else "--decode"
                raise ConfigError(
                    f"{addr} is a {md.get('role')} endpoint, not {role}",
                    f"give {flag} only {role} endpoints",
                )
        if first is not None and all(a in down for a in addrs):
            raise first
    return meta, down


def _check_pools(cfg: DriveConfig, meta: dict[str, dict[str, object]], up: list[str]) -> None:
    """``--blocks`` fits the pool of every peer that is up."""
    for addr in up:
        pool = meta[addr].get("num_blocks")
        if isinstance(pool, int) and cfg.blocks > pool:
            raise ConfigError(
                f"--blocks {cfg.blocks} exceeds the pool of {addr} ({pool} blocks)",
                f"use --blocks {pool} or fewer",
            )


def _check_compat(meta: dict[str, dict[str, object]], up: list[str], ref: str) -> None:
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


def _check_tp(cfg: DriveConfig, meta: dict[str, dict[str, object]]) -> None:
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


def check_shape(name: str, address: str, md: dict[str, object]) -> None:
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
