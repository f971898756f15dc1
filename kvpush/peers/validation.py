"""Pure checks of what a peer announces, before anything of it reaches NIXL."""

from __future__ import annotations

from kvpush.config import HandshakeMode, Role
from kvpush.errors import (
    HandshakeError,
    IncompatiblePeerError,
    PeerShuttingDownError,
    PeerUnreachableError,
)
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol


def handshake_failure(exc: BaseException, peer_role: Role) -> Failure:
    """The failure kind of a handshake error, by its type (never by its message text)."""
    if isinstance(exc, PeerUnreachableError):
        return (
            Failure.PREFILL_UNREACHABLE if peer_role == Role.PREFILL else Failure.DECODE_UNREACHABLE
        )
    if isinstance(exc, IncompatiblePeerError):
        return Failure.INCOMPATIBLE
    if isinstance(exc, PeerShuttingDownError):  # its roles stopped: it refuses handshakes
        return Failure.SHUTTING_DOWN
    return Failure.HANDSHAKE_FAILED


def mode_satisfies(have: HandshakeMode, want: HandshakeMode) -> bool:
    """A full handshake serves notif-only uses too; not the other way round."""
    return have == HandshakeMode.FULL or want == HandshakeMode.NOTIF


def check_compat(
    local: protocol.EndpointMetadata, remote_fields: dict[str, object], peer: str
) -> None:
    """Raise ``IncompatiblePeerError`` naming every compatibility field that differs."""
    diffs = protocol.compat_differences(protocol.compat_fields(local), remote_fields)
    if diffs:
        text = "; ".join(f"{f}: local={lv!r} remote={rv!r}" for f, lv, rv in diffs)
        raise IncompatiblePeerError(
            f"{peer} is incompatible: {text}",
            diffs,
            hint="start both endpoints with the same geometry, dtype and layout",
        )


def check_reply(
    local: protocol.EndpointMetadata, local_hash: str, rep: protocol.HandshakeRep, peer: str
) -> protocol.EndpointMetadata:
    """The peer's metadata, checked: compatibility hash *before* decoding, then every field."""
    if rep.compat_hash != local_hash:
        # Name the differing fields without trusting the metadata's schema.
        check_compat(
            local, protocol.compat_fields_loose(protocol.decode_metadata_loose(rep.metadata)), peer
        )
        raise HandshakeError(peer, "compatibility hash differs (no field differs: bad hash)")
    md = protocol.decode_metadata(rep.metadata)
    check_compat(local, protocol.compat_fields(md), peer)
    if len(md.region_base_addrs) != md.regions:
        raise HandshakeError(peer, "metadata lists a wrong number of region addresses")
    return md
