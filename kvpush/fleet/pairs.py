"""What the registry alone says about the fleet: which P x D pairs can work, how healthy a record
looks, how many blocks a push of a given size is.

Owns ``pair_differences`` (the compatibility fields two records disagree on, read from their
geometry and compat hash, the way ``kvpush.wire.side_messages.compat_fields`` compares two
endpoints' metadata: the *model's* page of a region, so endpoints of one model at different TP
sizes agree), ``record_health`` (a record's own freshness and load, no contact with the
endpoint) and ``blocks_for_size``. Pure functions over ``EndpointRecord`` s; no I/O, no threads.
"""

from __future__ import annotations

import math

from kvpush.config import Role
from kvpush.fleet.record import EndpointRecord

#: A load summary older than this is "stale": the endpoint stopped refreshing it (frozen, or cut
#: off from etcd while its lease still runs).
STALE_S = 25.0

Difference = tuple[str, object, object]  # (field, P's value, D's value)


def compat_fields(rec: EndpointRecord) -> dict[str, object]:
    """What must match for P to WRITE into D, from a record (protocol through compat_hash)."""
    g = rec.geometry
    page = g.block_bytes * rec.tp_size if g.kv_heads > 1 else g.block_bytes
    return {
        "wire": rec.wire,
        "dtype": g.dtype,
        "kv_layout": g.kv_layout,
        "block_bytes": page,
        "layers": g.layers,
        "regions": g.regions,
        "kv_heads": g.kv_heads,
    }


def pair_differences(p: EndpointRecord, d: EndpointRecord) -> list[Difference]:
    """Every field on which P and D disagree (empty: the pair can work): the wire and geometry
    fields, then the TP sizes (one must divide the other); a hash that differs on no named
    field is named itself (another protocol or model version)."""
    # Every field is compared, equal hashes or not: vLLM's hash leaves the block size out. A
    # field one side's metadata does not carry ("": vLLM's dtype, in its hash) is not named.
    pf, df = compat_fields(p), compat_fields(d)
    diffs = [(f, pf[f], df[f]) for f in pf if pf[f] != df[f] and "" not in (pf[f], df[f])]
    if not diffs and p.compat_hash != d.compat_hash:
        diffs.append(("compat_hash", p.compat_hash[:12], d.compat_hash[:12]))
    if p.tp_size % d.tp_size and d.tp_size % p.tp_size:
        diffs.append(("tp_size", p.tp_size, d.tp_size))
    return diffs


def format_differences(diffs: list[Difference]) -> str:
    """``dtype bfloat16 vs float16, layers 2 vs 4`` (P's value first)."""
    return ", ".join(f"{f} {pv} vs {dv}" for f, pv, dv in diffs)


def record_health(rec: EndpointRecord, now: float, stale_s: float = STALE_S) -> str:
    """``ok``, ``stale`` (no load summary for ``stale_s``), or ``full`` (a D with no free
    block): what the record shows, without asking the endpoint."""
    updated = rec.load.updated_at or rec.started_at
    if updated and now - updated > stale_s:
        return "stale"
    if rec.role == Role.DECODE and rec.load.updated_at and rec.load.free_blocks == 0:
        return "full"
    return "ok"


def block_total_bytes(rec: EndpointRecord) -> int:
    """Bytes one block of a push carries (every region of one rank's page)."""
    return max(1, rec.geometry.regions * rec.geometry.block_bytes)


def blocks_for_size(size_bytes: int, p: EndpointRecord, d: EndpointRecord) -> tuple[int, str]:
    """Blocks per push for ``size_bytes`` between P and D, and a note when it had to be capped
    at the smaller pool (a push never asks for more than a pool holds)."""
    want = max(1, math.ceil(size_bytes / block_total_bytes(p)))
    cap = max(1, min(p.geometry.num_blocks, d.geometry.num_blocks))
    if want > cap:
        return cap, f"{want} blocks asked, capped at the smaller pool ({cap})"
    return want, ""
