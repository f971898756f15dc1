"""Why a request failed, as one ``Failure`` value (the closed set) and free-text detail beside it.

Owns the mapping of everything that can end a request in the tools -- an error a client raised,
a peer's ``DecodeRep``/``PrefillRep`` reason, a bug in kvpush itself -- to
``kvpush.telemetry.names.Failure``, so that drive's summary groups failures by reason only and
the text that varies (addresses, counts, messages) stays in the detail. Pure functions; any
thread.
"""

from __future__ import annotations

from typing import TypeAlias

from kvpush.config import Role
from kvpush.errors import (
    AuthError,
    IncompatiblePeerError,
    KvpushError,
    NoFreeBlocksError,
    PeerError,
    PeerShuttingDownError,
    PeerTimeoutError,
    PeerUnreachableError,
    ProtocolError,
    ShuttingDownError,
)
from kvpush.telemetry.names import Failure

Leg: TypeAlias = Role  # the leg of a request: the role of the endpoint it talks to

UNREACHABLE: dict[Leg, Failure] = {
    Role.PREFILL: Failure.PREFILL_UNREACHABLE,
    Role.DECODE: Failure.DECODE_UNREACHABLE,
}

# Reasons P's PrefillRep carries today: a Failure value, an exception's class name, or
# "internal_error: <text>" (the core's PrefillRep has no detail field yet).
_PREFILL_CLASS_NAMES: dict[str, Failure] = {
    "ShuttingDownError": Failure.SHUTTING_DOWN,
    "NoFreeBlocksError": Failure.NO_FREE_BLOCKS,
    "KvpushError": Failure.BAD_REQUEST,  # P refused the request itself (e.g. an empty id)
}


# The typed errors whose reason is their class alone, in the order they are tried (a subclass
# before its base): those tried before the generic ``PeerError``, and those after it.
_BEFORE_PEER_ERROR: tuple[tuple[type[KvpushError], Failure], ...] = (
    (AuthError, Failure.AUTH_REJECTED),
    (IncompatiblePeerError, Failure.INCOMPATIBLE),
    (ShuttingDownError, Failure.SHUTTING_DOWN),
    (PeerShuttingDownError, Failure.SHUTTING_DOWN),
    (NoFreeBlocksError, Failure.NO_FREE_BLOCKS),
)
_AFTER_PEER_ERROR: tuple[tuple[type[KvpushError], Failure], ...] = (
    (ProtocolError, Failure.MALFORMED_FRAME),
    (KvpushError, Failure.INTERNAL_ERROR),
)


def from_error(e: BaseException, leg: Leg) -> tuple[Failure, str]:
    """The reason and detail of an exception raised while sending ``leg``."""
    if isinstance(e, PeerTimeoutError):  # it took the request: a timeout, not unreachable
        return Failure.DEADLINE, e.message
    if isinstance(e, PeerUnreachableError):
        return UNREACHABLE[leg], e.message
    for cls, reason in _BEFORE_PEER_ERROR:
        if isinstance(e, cls):
            return reason, e.message
    if isinstance(e, PeerError):
        # Another ErrorRep; an endpoint of an older kvpush refused "shutting down" by text.
        if "shutting down" in e.message:
            return Failure.SHUTTING_DOWN, e.message
        return Failure.BAD_REQUEST, e.message
    for cls, reason in _AFTER_PEER_ERROR:
        if isinstance(e, cls):
            return reason, e.message
    return Failure.INTERNAL_ERROR, f"{type(e).__name__}: {e}"


def from_served_error(e: BaseException, leg: Leg) -> tuple[Failure, str]:
    """``from_error`` for a leg sent to an endpoint that passed drive's checks: one that now
    answers "still starting" is another process (``starting``), ``peer_restarted``."""
    if isinstance(e, KvpushError) and starting(e):
        return Failure.PEER_RESTARTED, f"{e.message} (another process, not serving yet)"
    return from_error(e, leg)


def starting(e: KvpushError) -> bool:
    """``e`` is an endpoint's answer while it is still starting (its ranks not built yet: the
    side channel refuses every request with "starting"). Only a new process says so: one that
    passed drive's checks and served never does again, so a request refused so has found a new
    incarnation at that address -- evidence on the wire, like a handshake answered by another
    incarnation."""
    return e.message == "starting" or e.message.endswith(": starting")


def from_peer(reason: str, detail: str = "") -> tuple[Failure, str]:
    """A reason a peer named on the wire (a newer peer's unknown name keeps it in the detail)."""
    known = Failure.parse(reason) or _PREFILL_CLASS_NAMES.get(reason)
    if known is not None:
        return known, detail
    head, sep, rest = reason.partition(":")
    known = Failure.parse(head.strip()) if sep else None
    if known is not None:
        return known, "; ".join(x for x in (rest.strip(), detail) if x)
    return Failure.INTERNAL_ERROR, "; ".join(x for x in (f"peer reason {reason!r}", detail) if x)
