"""Which registry records ``drive --registry`` admits: the pure part of its checks.

A registry record is a hint, never proof: drive admits an endpoint only once it has answered
drive's own contact and fits the run. Owns

* ``unusable`` (a record drive could never drive: another wire, no role it drives, an address
  that does not parse), ``norm`` / ``normalized`` (addresses as drive's peer table writes them);
* ``contact_why`` (what contacting an endpoint found, and whether to look again: one that does
  not answer or is still starting is *pending*; one that answered as no side channel is *left
  out*);
* ``choose`` (the start: given every record and what contacting it found, the Ps and Ds the
  run starts with and its reference P -- the P that answered and fits (pool, ``--shape``) whose
  geometry most answering endpoints share, so one stale or stray P sorting first does not set
  the run's geometry --, the records left out and the pending ones);
* ``start_notes`` / ``said`` (the words for a record left out or pending: each named once).

Pure functions of records and metadata (``kvpush.commands.drive.preflight.misfit`` judges each
peer); ``kvpush.commands.drive.targets`` does the contacting and the following. Runs on any thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from kvpush.address import format_address, parse_address
from kvpush.commands.common.reasons import starting
from kvpush.commands.drive.preflight import check_shape, misfit
from kvpush.config import Role
from kvpush.errors import ConfigError, KvpushError, PeerUnreachableError
from kvpush.fleet.record import EndpointRecord
from kvpush.logsafe import shown
from kvpush.wire import protocol

#: This many records left out (or pending) for one reason at start get one note naming them all.
GROUP_AT = 4


def contact_why(address: str, err: KvpushError) -> tuple[str, bool]:
    """What contacting ``address`` found, without the address, and whether it is worth
    checking again (it does not answer, or is still starting) rather than leaving it out (it
    answered, but not as a side channel drive can use)."""
    msg = err.message
    for head in (f"{address}: ", f"{address} "):
        if msg.startswith(head):
            msg = msg[len(head) :]
            break
    if starting(err):
        return "still starting", True
    return msg, isinstance(err, PeerUnreachableError)


def geometry_key(md: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """What two endpoints must share to pair (``preflight.misfit``'s geometry), as a key."""
    return tuple((f, repr(v)) for f, v in protocol.compat_fields_loose(md).items())


@dataclass
class Start:
    """What ``choose`` made of the records at start: the Ps and Ds admitted (with their
    metadata and the run's reference P), the records left out and those pending (address ->
    (record, why))."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    meta: dict[str, dict[str, object]] = field(default_factory=dict)
    reference: str = ""
    out: dict[str, tuple[EndpointRecord, str]] = field(default_factory=dict)
    pending: dict[str, tuple[EndpointRecord, str]] = field(default_factory=dict)


def choose(
    records: Iterable[EndpointRecord],
    found: dict[str, dict[str, object] | KvpushError],
    blocks: int,
    shape: str = "",
) -> Start:
    """Which records the run starts with, from what contacting each found (pure). The
    reference P is the answering P (role, pool and ``shape`` fit) whose geometry most answering
    endpoints share (the first by address among equals); every other endpoint must have it."""
    st = Start()
    answered = _answered(st, records, found)
    candidates = _candidates(st, answered, blocks, shape)
    if not candidates:
        return st
    shared: dict[tuple[tuple[str, str], ...], int] = {}
    for _, md in answered:
        shared[geometry_key(md)] = shared.get(geometry_key(md), 0) + 1
    ref_rec, ref = max(candidates, key=lambda c: shared[geometry_key(c[1])])
    st.reference = ref_rec.address
    _admit(st, candidates, Role.PREFILL, blocks, ref_rec.address, ref)
    _admit(st, answered, Role.DECODE, blocks, ref_rec.address, ref)
    return st


def _answered(
    st: Start, records: Iterable[EndpointRecord], found: dict[str, dict[str, object] | KvpushError]
) -> list[tuple[EndpointRecord, dict[str, object]]]:
    """The records that answered as their registered role; the others go to ``st.out`` or
    ``st.pending`` (a contact that may succeed later)."""
    answered: list[tuple[EndpointRecord, dict[str, object]]] = []
    for rec in records:
        got = found.get(rec.address)
        if got is None:
            continue
        if isinstance(got, KvpushError):
            why, again = contact_why(rec.address, got)
            (st.pending if again else st.out)[rec.address] = (rec, why)
        elif got.get("role") != rec.role:
            st.out[rec.address] = (rec, f"registered as {rec.role}, it is a {got.get('role')}")
        else:
            answered.append((rec, got))
    return answered


def _candidates(
    st: Start, answered: list[tuple[EndpointRecord, dict[str, object]]], blocks: int, shape: str
) -> list[tuple[EndpointRecord, dict[str, object]]]:
    """The answering Ps whose pool and ``shape`` fit; the others go to ``st.out``."""
    candidates = []
    for rec, md in answered:
        if rec.role != Role.PREFILL:
            continue
        why = misfit(md, Role.PREFILL, blocks) or _shape_misfit(shape, rec.address, md)
        if why:
            st.out[rec.address] = (rec, why)
        else:
            candidates.append((rec, md))
    return candidates


def _admit(
    st: Start,
    answered: list[tuple[EndpointRecord, dict[str, object]]],
    role: Role,
    blocks: int,
    ref_address: str,
    ref: dict[str, object],
) -> None:
    """Each answering ``role`` endpoint that fits the reference ``ref`` joins the run (Ds are
    also checked against the admitted Ps, so Ps are admitted first); the others go to ``st.out``."""
    ps = [st.meta[a] for a in st.prefill] if role == Role.DECODE else []
    for rec, md in answered:
        if rec.role != role:
            continue
        why = misfit(md, role, blocks, ref, ps)
        if why:
            st.out[rec.address] = (rec, f"it does not fit {ref_address}: {why}")
            continue
        (st.prefill if role == Role.PREFILL else st.decode).append(rec.address)
        st.meta[rec.address] = md


def _shape_misfit(shape: str, address: str, md: dict[str, object]) -> str:
    if not shape:
        return ""
    try:
        check_shape(shape, address, md)
    except KvpushError as e:
        return e.message.removeprefix(f"{address} (prefill) ")
    return ""


def start_notes(
    out: dict[str, tuple[EndpointRecord, str]], pending: dict[str, tuple[EndpointRecord, str]]
) -> list[str]:
    """One note per record left out or pending -- or, for ``GROUP_AT`` or more with one
    reason, one note naming them all: every record is named once."""
    notes = []
    for kind, recs in (("out", out), ("pending", pending)):
        by: dict[str, list[EndpointRecord]] = {}
        for rec, why in recs.values():
            by.setdefault(why, []).append(rec)
        for why, group in by.items():
            if len(group) >= GROUP_AT:
                names = ", ".join(f"{r.role} {r.address}" for r in group)
                if kind == "out":
                    notes.append(f"registry: {len(group)} records left out ({why}): {names}")
                else:
                    notes.append(
                        f"registry: {len(group)} registered endpoints do not answer ({why}): "
                        f"each gets requests once it answers and fits: {names}"
                    )
                continue
            for r in group:
                notes.append(said(kind, r, why))
    return [shown(n) for n in notes]


def said(kind: str, rec: EndpointRecord, why: str) -> str:
    """What is said of one record left out or pending."""
    if kind == "out":
        return f"registry: {rec.role} {rec.address} left out: {why}"
    return (
        f"registry: {rec.role} {rec.address} does not answer ({why}): it gets requests once "
        "it answers and fits"
    )


def unusable(rec: EndpointRecord) -> str:
    """Why drive cannot drive ``rec`` whatever its endpoint says ("" when it may)."""
    if rec.wire != "kvpush":
        return f"wire {rec.wire}: drive drives kvpush endpoints"
    if rec.role not in (Role.PREFILL, Role.DECODE):
        return f"role {rec.role}"
    return unusable_address(rec.address)


def unusable_address(address: str) -> str:
    """Why ``address`` is no HOST:PORT ("" when it is one)."""
    try:
        parse_address(address)
    except ConfigError as e:
        return e.message
    return ""


def norm(address: str) -> str:
    """``address`` as drive writes it (its peer table's key); as it is when it does not parse."""
    try:
        return format_address(*parse_address(address))
    except ConfigError:
        return address


def normalized(rec: EndpointRecord) -> EndpointRecord:
    """``rec`` with its address as drive writes it."""
    address = norm(rec.address)
    return rec if address == rec.address else msgspec.structs.replace(rec, address=address)
