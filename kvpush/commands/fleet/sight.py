"""Listed endpoints (``--endpoints``, ``--peer``) seen: each asked who it is, as a record.

Owns ``sight`` (one entry: first contact, vLLM's ``get_meta_msg``, then -- for a kvpush
endpoint on its own wire only -- a notif-only ``HandshakeReq`` for its metadata and a
``StatsReq`` for its load) and ``sight_all`` (every entry, ``concurrency`` at a time, so a
file of 50 endpoints costs about ceil(50 / concurrency) contact timeouts, not 50). What comes
back is an ``EndpointRecord`` like the registry's, so that ``fleet ls``/``watch``/``check``
treat a listed endpoint and a registered one alike:

* a kvpush endpoint says its role, incarnation, TP size, geometry and load itself;
* a vLLM engine (or a kvpush endpoint on vLLM's wire) is read from its ``NixlAgentMetadata``
  (``kvpush.commands.common.like``): regions, block length, layout, its compatibility hash;
  ``wire`` is ``vllm`` and ``kvpush_version`` is empty for an engine (what tells the two
  apart). Its role and TP size come from the listing (vLLM's metadata carries neither).

A vLLM listener is only ever sent ``get_meta_msg`` for rank (0, 0), the one request it
survives. Anything that cannot be made into a record is a ``problem`` line (unreachable, not a
side channel -- e.g. an HTTP server --, a vLLM engine listed without its role). Runs on the
caller's thread and a bounded pool of short-lived contact threads; nothing is kept open.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.address import parse_address
from kvpush.commands.fleet.entries import Entry
from kvpush.config import Role
from kvpush.errors import KvpushError, PeerError, PeerTimeoutError
from kvpush.fleet.record import EndpointRecord, Geometry, Load, device_of
from kvpush.wire import protocol, vllm

if TYPE_CHECKING:
    from kvpush.transport.client import PeerIdentity, SideChannelClient

#: One listed endpoint's contact deadline (first contact, then each request).
CONTACT_TIMEOUT_S = 3.0
#: A contact that timed out is tried once more with this many times the deadline.
SLOW_RETRY = 3.0


@dataclass(frozen=True)
class Seen:
    entry: Entry
    record: EndpointRecord | None  # None: see ``problem``
    kind: str  # "kvpush" | "vllm" (an engine) | "unreachable" | "not_a_side_channel" | "error"
    problem: str = ""


def _role_of(entry: Entry, said: str) -> Role | None:
    if said in (Role.PREFILL.value, Role.DECODE.value):
        return Role(said)
    return entry.role


def _vllm_record(entry: Entry, ident: PeerIdentity, role: Role, now: float) -> EndpointRecord:
    from kvpush.commands.common.like import likeness_of

    payload = ident.payload
    kv = payload.kvpush
    lk = likeness_of(payload, entry.address)
    md = vllm.decode_agent_metadata(payload.agent_metadata_bytes)
    mem = (md.region_mem_types or ["DRAM"])[0]
    host, _ = parse_address(entry.address)
    return EndpointRecord(
        role=role,
        engine_id=lk.engine_id,
        incarnation=(kv.incarnation if kv is not None else "") or lk.engine_id,
        address=entry.address,
        host=host,
        pid=0,
        tp_size=entry.tp_size or (kv.tp_size if kv is not None else 1),
        wire="vllm",
        geometry=Geometry(
            num_blocks=md.num_blocks,
            layers=lk.layers,
            regions=len(md.kv_caches_base_addr),
            block_bytes=lk.block_bytes,
            dtype="",  # not in vLLM's metadata: its compatibility hash covers it
            kv_layout=lk.kv_layout,
            device=device_of(mem),
        ),
        compat_hash=payload.compatibility_hash,
        kvpush_version=kv.version if kv is not None else "",
        load=Load(updated_at=now),
    )


def _kvpush_record(entry: Entry, client: SideChannelClient, now: float) -> EndpointRecord:
    from kvpush.commands.common import control
    from kvpush.fleet.member import load_of
    from kvpush.telemetry.snapshot import snapshot_from_dict

    req = protocol.HandshakeReq(mode="notif", requester="kvpush-fleet", tp_rank=0)
    rep = control.call(client, req)
    if not isinstance(rep, protocol.HandshakeRep):
        raise PeerError(f"{entry.address} answered a handshake request with {type(rep).__name__}")
    md = protocol.decode_metadata(rep.metadata)
    load = Load(updated_at=now)
    stats = control.call(client, protocol.StatsReq())
    if isinstance(stats, protocol.StatsRep):
        # a snapshot of another version: the row shows no load
        with contextlib.suppress(ValueError):
            load = load_of(snapshot_from_dict(dict(stats.snapshot)))
    return EndpointRecord(
        role=md.role,
        engine_id=md.engine_id,
        incarnation=md.incarnation,
        address=entry.address,
        host=md.host,
        pid=0,
        tp_size=md.tp_size,
        wire="kvpush",
        geometry=Geometry.of(md, md.device_kind),
        compat_hash=protocol.compat_hash(md),
        kvpush_version=md.kvpush_version,
        nixl_version=md.nixl_version,
        started_at=now - float(getattr(stats, "snapshot", {}).get("uptime_s", 0.0) or 0.0),
        load=load,
    )


def sight(entry: Entry, token: bytes | None, timeout_s: float = CONTACT_TIMEOUT_S) -> Seen:
    """Who ``entry`` is, as a record, or the one line that says why not. A side channel that
    took the connection but did not answer in ``timeout_s`` is asked once more with
    ``SLOW_RETRY`` times the deadline: on a loaded host a live endpoint is slow (a vLLM engine's
    listener waits for its GIL; measured: with two busy loops beside three vLLM engines, two of
    four listed endpoints missed a 3 s contact), and calling it unseen would be wrong."""
    try:
        return _sight(entry, token, timeout_s)
    except PeerTimeoutError:
        pass
    try:
        return _sight(entry, token, timeout_s * SLOW_RETRY)
    except PeerTimeoutError as e:
        return Seen(entry, None, "error", f"{_where(entry)}: {_said(entry, e)} (asked twice)")


def _where(entry: Entry) -> str:
    return f"{entry.where}: {entry.address}" if entry.where else entry.address


def _said(entry: Entry, e: KvpushError) -> str:
    """The error without the address it starts with."""
    return e.message.removeprefix(f"{entry.address}: ").removeprefix(f"{entry.address} ")


def _sight(entry: Entry, token: bytes | None, timeout_s: float) -> Seen:
    """One look; a side channel that took the connection but did not answer in time raises
    ``PeerTimeoutError`` (``sight`` asks once more)."""
    from kvpush.commands.common import control

    where = _where(entry)
    try:
        control.first_contact(entry.address, timeout_s)
    except control.UnreachablePeer as e:
        return Seen(entry, None, "unreachable", f"{where}: unreachable ({_said(entry, e)})")
    except control.NotASideChannel as e:
        return Seen(entry, None, "not_a_side_channel", f"{where}: {_said(entry, e)}")
    try:
        with control.connect(entry.address, token, timeout_s) as client:
            return _asked(entry, client, token, where)
    except PeerTimeoutError:
        raise
    except KvpushError as e:
        return Seen(entry, None, "error", f"{where}: {_said(entry, e)}")


def _asked(entry: Entry, client: SideChannelClient, token: bytes | None, where: str) -> Seen:
    """Ask the side channel who it is (first contact, then kvpush's requests where it may)."""
    now = time.time()
    ident = client.identify(0, 0)
    kv = ident.kvpush
    role = _role_of(entry, kv.role if kv is not None else "")
    if kv is not None and kv.auth and token is None:
        return Seen(entry, None, "kvpush", f"{where}: a kvpush endpoint that needs a "
                    "token: pass --auth-token-file")  # fmt: skip
    if kv is None or kv.wire == "vllm":
        if role is None:
            return Seen(entry, None, "vllm", f"{where}: a vLLM side channel, whose "
                        "metadata does not say its role: list it as 'HOST:PORT "
                        "prefill' or 'HOST:PORT decode'")  # fmt: skip
        rec = _vllm_record(entry, ident, role, now)
        return Seen(entry, rec, "vllm" if kv is None else "kvpush")
    rec = _kvpush_record(entry, client, now)
    if entry.role is not None and entry.role != rec.role:
        what = f"{where}: listed as {entry.role.value}, but the endpoint says it is a "
        return Seen(entry, rec, "kvpush", what + f"{rec.role.value} endpoint: its word is kept")
    return Seen(entry, rec, "kvpush")


def sight_all(
    entries: Sequence[Entry],
    token: bytes | None,
    concurrency: int,
    timeout_s: float = CONTACT_TIMEOUT_S,
) -> list[Seen]:
    """Every entry seen, in listing order, at most ``concurrency`` contacts at once."""
    if not entries:
        return []
    with ThreadPoolExecutor(max(1, min(concurrency, len(entries))), "fleet-sight") as ex:
        return list(ex.map(lambda e: sight(e, token, timeout_s), entries))
