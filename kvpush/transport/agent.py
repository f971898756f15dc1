"""The NIXL agent as the engine sees it: the ``Agent`` protocol, its handles and its words.

``kvpush.transport.nixl.NixlAgent`` is the one real implementation (the only module that imports
``nixl``); the tests' ``FakeAgent`` (tests/support/fakes.py) is the other. The writer, the decode
receiver, the handshake manager, the owner loop and the fence path are typed against ``Agent``, so
either can be handed to them as it is.

It owns the closed vocabularies at that seam: ``XferState`` (what NIXL says of a transfer:
``DONE``, ``PROC``, ``ERR``) and ``TransferKind`` (what kind of failure a ``TransferError``
reports). Both are ``StrEnum``s whose values are NIXL's and kvpush's strings, so logs, JSON and
comparisons with those strings read the same as before. Pure types: no thread runs here.
"""

from __future__ import annotations

from typing import Final, Protocol, TypeAlias

import numpy as np

from kvpush.errors import KvpushError
from kvpush.telemetry.names import StrEnum

#: Indices into a prepared descriptor list (``kvpush.memory.descriptors.Indices``).
Indices: TypeAlias = np.ndarray | list[int]


class XferState(StrEnum):
    """A transfer's state, as NIXL's ``transfer`` / ``check_xfer_state`` name it."""

    DONE = "DONE"  # every byte landed (and the notification, if any, was sent)
    PROC = "PROC"  # still in progress
    ERR = "ERR"  # failed; NIXL raised nothing, the state says it


#: The states as module constants, for the owner thread's poll loop: ``XferState.DONE`` is a
#: lookup through the enum's metaclass, several times slower than a module global on Python 3.11.
XFER_DONE: Final = XferState.DONE
XFER_ERR: Final = XferState.ERR


class TransferKind(StrEnum):
    """What a ``TransferError`` says went wrong."""

    PEER_DEAD = "peer_dead"  # the remote disconnected (NIXL_ERR_REMOTE_DISCONNECT)
    PEER_UNKNOWN = "peer_unknown"  # the remote agent is not loaded (or was removed: stale)
    NOT_ALLOWED = "not_allowed"
    BACKEND = "backend"
    CANCELLED = "cancelled"
    NIXL_ERROR = "nixl_error"  # any other NIXL exception
    BAD_METADATA = "bad_metadata"  # bytes that are not NIXL agent metadata (refused unparsed)
    XFER_ERROR = "xfer_error"  # a transfer whose state turned ERR
    TIMEOUT = "timeout"  # a WRITE not done by its deadline (degrades a peer, never evicts)


#: The kinds that say the remote agent is gone: its peer is evicted on the first.
GONE: frozenset[TransferKind] = frozenset({TransferKind.PEER_DEAD, TransferKind.PEER_UNKNOWN})


class TransferError(KvpushError):
    """A NIXL call on a transfer or notification failed.

    ``kind`` says what (``TransferKind``); ``status`` is NIXL's status name
    (``NIXL_ERR_REMOTE_DISCONNECT``...), or ``xfer_state_err`` / ``stale_agent`` /
    ``write_timeout`` where NIXL raised nothing (a transfer whose state turned ERR; a call refused
    by the adapter; a WRITE past its deadline).
    """

    def __init__(self, kind: TransferKind, message: str, status: str = "NIXL_ERR_UNKNOWN") -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


class Handle(Protocol):
    """A NIXL handle (a transfer or a prepared descriptor list): released once by its owner."""

    def release(self) -> None: ...


class Xfer:
    """One posted transfer; released exactly once by its owner."""

    __slots__ = ("handle", "released")

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.released = False


class DList:
    """One prepared descriptor list (local, or of the remote agent ``remote``)."""

    __slots__ = ("count", "handle", "remote")

    def __init__(self, handle: Handle, count: int, remote: str = "") -> None:
        self.handle = handle
        self.count = count
        self.remote = remote  # the remote agent it describes ("" for a local list)


class Agent(Protocol):
    """The calls the engine makes on a NIXL agent (``NixlAgent``; ``FakeAgent`` in the tests).

    Threads: the owning thread posts, polls and sends; handshake workers load remote agents and
    prepare their lists; an implementation serialises what must be.
    """

    @property
    def etcd_metadata(self) -> bool:
        """Whether agents' metadata goes through NIXL's etcd backend (``fetch_remote``)."""
        ...

    # -- metadata
    def metadata_full(self) -> bytes: ...

    def metadata_conn_only(self) -> bytes: ...

    def fetch_remote(self, name: str, timeout_s: float) -> str: ...

    def add_remote(self, metadata: bytes) -> str: ...

    def remove_remote(self, name: str) -> None: ...

    def drop_remote_under(self, name: str) -> None: ...

    def make_connection(self, name: str) -> None: ...

    # -- descriptor lists
    def prep_local(self, descs: np.ndarray, mem_type: str) -> DList: ...

    def prep_remote(self, name: str, descs: np.ndarray, mem_type: str) -> DList: ...

    def release_dlist(self, dl: DList) -> None: ...

    # -- transfers and notifications
    def post_write(
        self, local: DList, local_idx: Indices, remote: DList, remote_idx: Indices, notif: bytes
    ) -> tuple[Xfer, XferState]: ...

    def state(self, x: Xfer) -> XferState: ...

    def release(self, x: Xfer) -> bool: ...

    def send_notif(self, name: str, msg: bytes) -> None: ...

    def get_notifs(self) -> dict[str, list[bytes]]: ...

    def close(self) -> None: ...
