"""The NIXL notifications of kvpush's wire protocol (v1): registrations, completions and the rest.

Owns the notification structs -- ``PushReg`` (D's blocks are ready), ``PushRegs`` (several
requests' ``PushReg``s in one notification), ``Completion`` (attached to P's WRITE),
``Completions`` (attached to one WRITE that carries several requests: coalesced pushes),
``Heartbeat``, ``Failure``, ``Cancel``, ``Fence``, ``Ping`` -- and their union
``Notif``. Declarations only (no I/O, no threads); framing, size checks and the reusable
decoder are ``kvpush.wire.protocol``'s, which also keeps the version history; sealing and
opening them per wire is ``kvpush.wire.notifs``.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypeAlias

from msgspec import Meta, Struct
from msgspec.structs import replace

from kvpush.wire.fields import Clock, Groups, NonNeg, Port, SmallPos, Str1k, Str128, Str256

# ----------------------------------------------------------------------------------- notifications


class PushReg(Struct, tag="push_reg", frozen=True, kw_only=True):
    """D -> every agent of P: D's blocks for a request are ready to be written into."""

    request_id: Str256
    transfer_id: Str256 = ""
    decode_engine_id: Str128
    decode_host: Str256
    decode_port: Port
    decode_tp_size: SmallPos = 1
    local_block_ids: Groups
    remote_engine_id: Str128
    remote_host: Str256
    remote_port: Port
    remote_tp_size: SmallPos = 1
    remote_pp_size: SmallPos = 1
    decode_incarnation: Str128 = ""
    decode_tp_rank: NonNeg = 0
    # D takes ``Completions`` (one notification naming several requests): P may coalesce this
    # request's WRITE with others to the same D rank. Absent (False) from an older kvpush D
    # and from vLLM's form: P then attaches a single ``Completion``, as before.
    batch_done: bool = False


#: The most registrations one ``PushRegs`` carries (D also keeps its encoded size well under the
#: notification limit: ``kvpush.decode.registrar``).
MAX_BATCH_REGS = 64


class Reg(Struct, array_like=True, frozen=True):
    """One request of a ``PushRegs``: the fields of its ``PushReg`` that differ per request."""

    request_id: Str256
    local_block_ids: Groups
    transfer_id: Str256 = ""
    remote_pp_size: SmallPos = 1


class PushRegs(Struct, tag="push_regs", frozen=True, kw_only=True):
    """D -> one agent of P: several requests' blocks are ready, each exactly as its own
    ``PushReg`` would say (``expand``); the fields they share are carried once. Sent only to a
    P whose metadata says ``takes_push_regs``; P handles each in order, as if it came alone."""

    decode_engine_id: Str128
    decode_host: Str256
    decode_port: Port
    decode_tp_size: SmallPos = 1
    remote_engine_id: Str128
    remote_host: Str256
    remote_port: Port
    remote_tp_size: SmallPos = 1
    decode_incarnation: Str128 = ""
    decode_tp_rank: NonNeg = 0
    batch_done: bool = False
    regs: Annotated[list[Reg], Meta(min_length=1, max_length=MAX_BATCH_REGS)]

    @classmethod
    def of(cls, regs: list[PushReg]) -> PushRegs:
        """The registrations as one notification; each must share the first's common fields
        (``shares``)."""
        return cls(
            **_shared(regs[0]),
            regs=[
                Reg(x.request_id, x.local_block_ids, x.transfer_id, x.remote_pp_size) for x in regs
            ],
        )

    def expand(self) -> list[PushReg]:
        """Each request's ``PushReg``, as it would have come alone: one built with the shared
        fields, copied with each request's own (0.44 us a registration; 1.27 built whole)."""
        first = self.regs[0]
        shared = PushReg(
            request_id=first.request_id, local_block_ids=first.local_block_ids, **_shared(self)
        )
        return [
            replace(
                shared,
                request_id=g.request_id,
                transfer_id=g.transfer_id,
                local_block_ids=g.local_block_ids,
                remote_pp_size=g.remote_pp_size,
            )
            for g in self.regs
        ]


#: The fields of a ``PushReg`` that a ``PushRegs`` carries once for all its registrations.
SHARED_FIELDS = tuple(f for f in PushRegs.__struct_fields__ if f != "regs")


#: Those fields' values, as a tuple (C-fast: ``shares`` runs once per registration in D's batch).
_shared_values = operator.attrgetter(*SHARED_FIELDS)


def _shared(m: PushReg | PushRegs) -> dict[str, Any]:
    # Any: each value goes back into the field of the same name of the other struct.
    return dict(zip(SHARED_FIELDS, _shared_values(m), strict=True))


def shares(a: PushReg, b: PushReg) -> bool:
    """Whether ``a`` and ``b`` can go in one ``PushRegs`` (the fields it carries once agree)."""
    return bool(_shared_values(a) == _shared_values(b))


class Completion(Struct, tag="done", frozen=True, kw_only=True):
    """Attached to P's WRITE: the blocks of ``request_id`` have landed."""

    request_id: Str256
    transfer_id: Str256 = ""
    p_tp_size: SmallPos = 1
    p_tp_rank: NonNeg = 0
    nbytes: NonNeg = 0


#: The most requests one ``Completions`` names (P's writer also keeps its encoded size well
#: under the notification limit).
MAX_BATCH_DONE = 256


class Done(Struct, array_like=True, frozen=True):
    """One request of a ``Completions``: the fields a single ``Completion`` carries for it."""

    request_id: Str256
    transfer_id: Str256 = ""
    nbytes: NonNeg = 0


class Completions(Struct, tag="done_n", frozen=True, kw_only=True):
    """Attached to one WRITE of P that carries the blocks of several requests to one D rank
    (sent only to a D whose PUSH_REGs said ``batch_done``): each named request's blocks have
    landed, exactly as a ``Completion`` of its own would say."""

    p_tp_size: SmallPos = 1
    p_tp_rank: NonNeg = 0
    done: Annotated[list[Done], Meta(min_length=1, max_length=MAX_BATCH_DONE)]


class Heartbeat(Struct, tag="hb", frozen=True, kw_only=True):
    """D -> P: D still waits for these transfers; P extends their leases."""

    transfer_ids: Annotated[list[Str256], Meta(max_length=4096)]


class Failure(Struct, tag="fail", frozen=True, kw_only=True):
    """P -> D: P cannot push this request; D fails it at once with the reason. With no
    ``request_id``: this P rank stops and writes nothing more (sent at the end of its drain),
    so D fails every request still drawing on it with the reason."""

    request_id: Str256
    transfer_id: Str256 = ""
    reason: Str128
    detail: Str1k = ""
    may_have_written: bool = False  # True: bytes may still land; D quarantines until a Fence


class Cancel(Struct, tag="cancel", frozen=True, kw_only=True):
    """D -> P: D abandoned this request; P must not WRITE into its blocks, and fences.

    Carries D's side-channel address so that P can acknowledge even before it ever connected
    to D (the common case: D's deadline passes before P finished its blocks), and D's
    incarnation, so that P acknowledges to the incarnation that cancelled: a P still holding
    the connection of a D that restarted at that address drops it first, as for a PUSH_REG
    (absent from an older kvpush D: then any incarnation matches)."""

    request_id: Str256
    transfer_id: Str256 = ""
    decode_host: Str256 = ""
    decode_port: Port = 0
    decode_tp_rank: NonNeg = 0
    decode_incarnation: Str128 = ""

    @classmethod
    def of(cls, reg: PushReg) -> Cancel:
        """The Cancel of the request ``reg`` registered, as its D would send it (each of its
        fields is the PUSH_REG's field of that name)."""
        return cls(**{f: getattr(reg, f) for f in cls.__struct_fields__})


class Fence(Struct, tag="fence", frozen=True, kw_only=True):
    """P -> D, attached to a small WRITE into an abandoned request's (quarantined) block: every
    earlier WRITE of P to D has landed, so D may reuse the blocks of ``request_ids``."""

    fence_id: Str128
    request_ids: Annotated[list[Str256], Meta(max_length=4096)] = []


class Ping(Struct, tag="ping", frozen=True, kw_only=True):
    """Notification round trip probe: the peer answers with ``reply=True`` to ``reply_host:port``
    (handshaking back to it first if needed)."""

    seq: NonNeg
    reply: bool = False
    reply_host: Str256 = ""
    reply_port: Port = 0
    sent_at: Clock = 0.0
    reply_rank: NonNeg = 0


Notif: TypeAlias = (
    PushReg | PushRegs | Completion | Completions | Heartbeat | Failure | Cancel | Fence | Ping
)
