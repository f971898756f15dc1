"""Typed errors of the kvpush library.

Every error a caller can act on is a ``KvpushError`` carrying a one-line message and a hint. The
library raises these and never exits; the CLI maps ``exit_status`` to the process exit code.
"""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    """Exit statuses operators script against (documented in the README)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    NOT_READY = 3  # peer answered but is not ready or is incompatible
    UNREACHABLE = 69  # EX_UNAVAILABLE: peer did not answer
    INTERRUPTED = 130


class KvpushError(Exception):
    """Base of all kvpush errors: a message, a hint an operator can act on, an exit status."""

    exit_status: ExitStatus = ExitStatus.ERROR
    default_hint: str = ""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def __str__(self) -> str:
        return self.message


class ConfigError(KvpushError):
    """Invalid option, value or configuration file."""

    exit_status = ExitStatus.USAGE


class DeviceError(KvpushError):
    """The requested device (cpu / cuda[:N]) is not usable on this host."""

    exit_status = ExitStatus.USAGE


class NixlUnavailableError(KvpushError):
    """NIXL, or a requested NIXL backend, is missing or failed to start."""

    default_hint = "install NIXL with 'pip install nixl' and check --backends (UCX is the default)"


class BindError(KvpushError):
    """The side channel (or metrics port) could not bind its address."""

    default_hint = "choose another --port (0 picks a free one) or stop the process using it"


class PeerUnreachableError(KvpushError):
    """A peer did not answer within its deadline."""

    exit_status = ExitStatus.UNREACHABLE
    default_hint = "check the address and that the peer is running ('kvpush probe HOST:PORT')"


class PeerTimeoutError(PeerUnreachableError):
    """No connection or no answer within the caller's deadline: a timeout (the peer may be
    slow, frozen or gone, or the deadline too short), not a refusal; still exit 69."""


class PeerError(KvpushError):
    """A peer answered with an error, or is not ready."""

    exit_status = ExitStatus.NOT_READY


class PeerShuttingDownError(PeerError):
    """A peer refused a request because it is shutting down (its side channel's ``shutting_down``
    refusal, or a first-contact answer that says so): news about the peer, not a fault of it."""


class IncompatiblePeerError(PeerError):
    """A peer's geometry, dtype, layout or protocol version differs from ours."""

    def __init__(
        self, message: str, differences: list[tuple[str, object, object]], hint: str | None = None
    ) -> None:
        super().__init__(message, hint)
        self.differences = differences


class AuthError(PeerError):
    """A message failed authentication (bad or missing tag, replay, stale timestamp)."""

    default_hint = "both sides must use the same --auth-token-file"


class ProtocolError(KvpushError):
    """A frame or notification could not be decoded (malformed, oversized, wrong version)."""


class BadValueError(ProtocolError):
    """A well-formed message with a field out of its range (inf, nan, negative, huge)."""


class HandshakeError(KvpushError):
    """A handshake to a peer failed; the message names the peer and the reason."""

    def __init__(self, peer: str, reason: str, hint: str | None = None) -> None:
        super().__init__(f"handshake with {peer} failed: {reason}", hint)
        self.peer = peer
        self.reason = reason


class NoFreeBlocksError(KvpushError):
    """The block pool has not enough free blocks: the request is refused, nothing allocated."""

    exit_status = ExitStatus.NOT_READY
    default_hint = "raise --num-blocks, lower the load, or wait for in-flight requests to finish"


class ShuttingDownError(KvpushError):
    """The endpoint is draining and refuses new work."""

    exit_status = ExitStatus.NOT_READY


class WrongWireError(IncompatiblePeerError):
    """The peer speaks another wire than this side: a vLLM engine where kvpush was expected,
    or the other way round. Nothing but ``get_meta_msg`` was sent to it."""

    def __init__(self, message: str, peer_kind: str, hint: str | None = None) -> None:
        super().__init__(
            message, [("wire", "kvpush" if peer_kind == "vllm" else "vllm", peer_kind)], hint
        )
        self.peer_kind = peer_kind


class RankFailedError(KvpushError):
    """A tensor-parallel rank of this endpoint has failed: it serves no request any more."""


class RegistryUnavailable(KvpushError):
    """No etcd client URL of the registry answered within its deadline."""

    exit_status = ExitStatus.UNREACHABLE
    default_hint = (
        "check --registry (etcd client URLs, e.g. http://10.0.0.5:2379,http://10.0.0.6:2379) "
        "and that etcd runs and is reachable from this host"
    )


class RegistryError(KvpushError):
    """etcd answered, with an error: refused credentials, no permission, a bad request."""

    default_hint = "check --registry-user, the password file and the TLS options"


class LeaseLost(RegistryError):
    """The lease a key was written with is gone (expired or revoked): grant a new one."""

    default_hint = "the endpoint grants a new lease and writes its key again by itself"


class WatchCompacted(RegistryError):
    """A watch asked for history etcd has compacted away: list again, then watch from there."""

    default_hint = "list the prefix again and watch from the revision of that listing"
