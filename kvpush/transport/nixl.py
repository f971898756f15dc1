"""The only module that imports ``nixl``: a narrow, typed wrapper around one NIXL agent.

``NixlAgent`` implements ``kvpush.transport.agent.Agent`` (handles, ``XferState``,
``TransferError`` live there). It translates NIXL's exceptions into kvpush's typed errors, fixes
the agent configuration kvpush relies on (no spinning progress thread by default, read/write
thread-sync so background handshakes may load agents while the owning thread posts transfers),
keeps NIXL's INFO logs off stdout and loads NIXL's wheel without torch (``transport.wheel``). It
holds no policy: callers decide what to do with each failure.

Threads: the owning thread (P's writer, D's receiver) calls post/state/notifs; handshake workers
call add_remote/prep_remote/make_connection; NIXL's RW sync mode serialises what must be. Agent
creation is serialised process-wide (``_CREATE_LOCK``): the ranks of one endpoint create their
agents on their own threads, and UCX 1.20.0 hangs when two agents initialise at once (NIXL #1668).

Remote agents: the adapter keeps the names it loaded (``remote_agents``) and the ones it removed;
a send or transfer towards a removed agent is refused here (``TransferError`` kind
``peer_unknown``) and counted in ``stale_agent_uses``, so nothing ever goes through a stale agent
of a peer that restarted, and tests can assert that it never happened.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import Protocol

import numpy as np

from kvpush.config import AgentConfig
from kvpush.errors import NixlUnavailableError
from kvpush.transport import lanes
from kvpush.transport.agent import (
    DList,
    Handle,
    Indices,
    TransferError,
    TransferKind,
    Xfer,
    XferState,
)
from kvpush.transport.wheel import nixl_wheel

__all__ = ["DList", "NixlAgent", "TransferError", "TransferKind", "Xfer", "XferState"]

log = logging.getLogger(__name__)

# NIXL logs twice: its Python layer (INFO lines to stdout) and its C++ core (absl, glog-style
# lines such as "E1201 ... genNotif ... NIXL_ERR_REMOTE_DISCONNECT" on stderr), both set by
# NIXL_LOG_LEVEL, read when the library loads. Every NIXL error that matters reaches kvpush as a
# status it translates (TransferError, NixlUnavailableError) and logs in its own words, once:
# NIXL's own lines are left out unless the operator asks for them (NIXL_LOG_LEVEL=WARN, DEBUG).
os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")

_AGENT_MD_MAGIC = b"nixlSerDes|Agent"  # how nixl 1.5's serialized agent metadata starts

_nixl: ModuleType | None = None
_bind: ModuleType | None = None

#: One agent at a time is created in this process (NIXL #1668: UCX 1.20.0 hangs when two agents
#: initialise at once, which is what the ranks of one endpoint would do).
_CREATE_LOCK = threading.Lock()

#: NIXL's status names by the exception class its Python API raises for them.
NIXL_STATUS = {
    "nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT",
    "nixlNotFoundError": "NIXL_ERR_NOT_FOUND",
    "nixlNotAllowedError": "NIXL_ERR_NOT_ALLOWED",
    "nixlBackendError": "NIXL_ERR_BACKEND",
    "nixlCancelledError": "NIXL_ERR_CANCELED",
    "nixlInvalidParamError": "NIXL_ERR_INVALID_PARAM",
    "nixlMismatchError": "NIXL_ERR_MISMATCH",
    "nixlNotPostedError": "NIXL_ERR_NOT_POSTED",
    "nixlNotSupportedError": "NIXL_ERR_NOT_SUPPORTED",
    "nixlRepostActiveError": "NIXL_ERR_REPOST_ACTIVE",
    "nixlUnknownError": "NIXL_ERR_UNKNOWN",
}


def _import_nixl() -> tuple[ModuleType, ModuleType]:
    global _nixl, _bind
    if _nixl is None:
        try:
            wheel = nixl_wheel()
            api = importlib.import_module(f"{wheel}._api")
            bind = importlib.import_module(f"{wheel}._bindings")
        except Exception as e:  # ImportError, or a broken native library
            raise NixlUnavailableError(f"NIXL is not available: {e}") from None
        logging.getLogger("nixl").setLevel(logging.WARNING)
        _nixl, _bind = api, bind
    assert _bind is not None
    return _nixl, _bind


def nixl_version() -> str:
    try:
        from importlib.metadata import version

        return version("nixl")
    except Exception:
        return "unknown"


#: kvpush's failure kind by the exception class NIXL's Python API raises.
_KINDS = {
    "nixlRemoteDisconnectError": TransferKind.PEER_DEAD,
    "nixlNotFoundError": TransferKind.PEER_UNKNOWN,
    "nixlNotAllowedError": TransferKind.NOT_ALLOWED,
    "nixlBackendError": TransferKind.BACKEND,
    "nixlCancelledError": TransferKind.CANCELLED,
}

#: NIXL's state strings (``transfer`` / ``check_xfer_state``) as ``XferState``s: one dict look-up
#: per poll.
_STATES = {s.value: s for s in XferState}


def _translate(e: BaseException, what: str) -> TransferError:
    name = type(e).__name__
    kind = _KINDS.get(name, TransferKind.NIXL_ERROR)
    return TransferError(kind, f"{what}: {name}: {e}", NIXL_STATUS.get(name, "NIXL_ERR_UNKNOWN"))


class _RawAgent(Protocol):
    """The calls this adapter makes on NIXL's ``nixl_agent`` (nixl 1.5's Python API)."""

    def get_plugin_list(self) -> Iterable[str]: ...
    def create_backend(self, backend: str, initParams: dict[str, str]) -> object: ...
    def register_memory(
        self, reg_list: object, mem_type: str | None = None, backends: list[str] | None = None
    ) -> object: ...
    def deregister_memory(self, dereg_list: object) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def get_partial_agent_metadata(
        self, descs: object, inc_conn_info: bool, backends: list[str]
    ) -> bytes: ...
    def send_local_metadata(self) -> None: ...
    def invalidate_local_metadata(self) -> None: ...
    def check_remote_metadata(self, remote_agent: str) -> bool: ...
    def fetch_remote_metadata(self, remote_agent: str) -> None: ...
    def add_remote_agent(self, metadata: bytes) -> bytes | str: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def make_connection(self, remote_agent: str) -> None: ...
    def prep_xfer_dlist(self, agent_name: str, xfer_list: np.ndarray, mem_type: str) -> Handle: ...
    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: Handle,
        local_indices: Indices,
        remote_xfer_side: Handle,
        remote_indices: Indices,
        notif_msg: bytes,
    ) -> Handle: ...
    def transfer(self, handle: Handle) -> str: ...
    def check_xfer_state(self, handle: Handle) -> str: ...
    def send_notif(self, remote_agent_name: str, notif_msg: bytes) -> None: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...


class NixlAgent:
    """One NIXL agent with kvpush's configuration."""

    def __init__(self, name: str, cfg: AgentConfig) -> None:
        api, bind = _import_nixl()
        self.name = name
        self.cfg = cfg
        if cfg.etcd_endpoints:
            # NIXL reads these when an agent is created (and only then); every agent of this
            # process shares them.
            os.environ["NIXL_ETCD_ENDPOINTS"] = cfg.etcd_endpoints
            os.environ["NIXL_ETCD_NAMESPACE"] = cfg.etcd_namespace
        conf = api.nixl_agent_config(
            enable_prog_thread=cfg.progress_thread,
            enable_listen_thread=False,
            num_threads=cfg.num_threads,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        # Lanes (``kvpush.transport.lanes``): UCX reads UCX_PROTO_INFO and, at the process's
        # first agent, UCX_LOG_FILE while the agent is created; they are set just for that.
        with _CREATE_LOCK, lanes.creating(cfg.lanes, name):
            self._agent = self._create(api, name, conf, cfg)
        self._reg: object | None = None
        self._lock = threading.Lock()  # guards the two name sets (owner and handshake threads)
        # Serialises the calls that change which remote agents NIXL holds (load, connect,
        # fetch, remove). NIXL's remove_remote_agent (invalidateRemoteMD) keeps the interpreter
        # lock while it waits for the agent's own lock, which a load or connect on a handshake
        # thread may hold while UCX waits on a peer that is tearing down: every thread of the
        # process would stop. Waiting here first, in Python, frees the interpreter lock: the
        # remover waits (bounded by the connect), the rest of the endpoint runs on
        # (docs/reliability.md, "Freeze watchdog").
        self._md_lock = threading.Lock()
        self._remotes: set[str] = set()
        self._removed: set[str] = set()
        self.stale_agent_uses = 0
        self._dram = bind.DRAM_SEG
        self._bind = bind

    @staticmethod
    def _create(api: ModuleType, name: str, conf: object, cfg: AgentConfig) -> _RawAgent:
        """The agent and its backends (under ``_CREATE_LOCK``: backend start is UCX's init)."""
        try:
            agent: _RawAgent = api.nixl_agent(name, conf)
        except Exception as e:
            raise NixlUnavailableError(f"cannot create a NIXL agent: {e}") from None
        available = list(agent.get_plugin_list())
        for b in cfg.backends:
            if b not in available:
                raise NixlUnavailableError(
                    f"NIXL backend {b} is not available",
                    f"available backends here: {', '.join(sorted(available)) or 'none'}",
                )
            try:
                agent.create_backend(
                    b, {"num_threads": str(cfg.num_threads)} if cfg.num_threads else {}
                )
            except Exception as e:
                raise NixlUnavailableError(f"NIXL backend {b} failed to start: {e}") from None
        return agent

    # ------------------------------------------------------------------ memory / metadata
    def register(self, tensor: object) -> None:
        """Register a torch tensor's memory (the bench's raw agents)."""
        try:
            self._reg = self._agent.register_memory(tensor, backends=list(self.cfg.backends))
        except Exception as e:
            raise NixlUnavailableError(f"cannot register the KV pool with NIXL: {e}") from None

    def register_region(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> None:
        """Register ``nbytes`` at ``addr`` (``DRAM`` or ``VRAM`` of ``device_id``): the pool."""
        try:
            self._reg = self._agent.register_memory(
                [(addr, nbytes, device_id, "")], mem_type, backends=list(self.cfg.backends)
            )
        except Exception as e:
            raise NixlUnavailableError(f"cannot register the KV pool with NIXL: {e}") from None

    def deregister(self) -> None:
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as e:  # pragma: no cover - shutdown path
                log.warning("deregister_memory failed: %s", e)
            self._reg = None

    def metadata_full(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def metadata_conn_only(self) -> bytes:
        """Connection-only partial metadata (~335 B): enough for notifications, no regions."""
        empty = self._bind.nixlRegDList(self._dram)
        return bytes(self._agent.get_partial_agent_metadata(empty, True, list(self.cfg.backends)))

    # ------------------------------------------------------------------ NIXL's etcd backend
    @property
    def etcd_metadata(self) -> bool:
        return bool(self.cfg.etcd_endpoints)

    def publish(self) -> None:
        """Publish this agent's full metadata with NIXL's etcd backend. NIXL 1.5.1 returns
        at once and only logs when etcd cannot be reached (the metadata is then simply not
        there): kvpush publishes again whenever its registration is renewed."""
        try:
            self._agent.send_local_metadata()
        except Exception as e:
            raise _translate(e, "send_local_metadata") from None

    def withdraw(self) -> None:
        """Delete this agent's metadata from etcd (peers' NIXL watchers then drop it)."""
        try:
            self._agent.invalidate_local_metadata()
        except Exception as e:  # shutdown path: the registry cleans up after a lapse anyway
            log.debug("invalidate_local_metadata failed: %s", e)

    def fetch_remote(self, name: str, timeout_s: float) -> str:
        """Load the agent ``name`` from etcd (NIXL fetches it asynchronously: poll until it is
        loaded or ``timeout_s`` passed)."""
        import time

        try:
            if self._agent.check_remote_metadata(name):
                return name
            with self._md_lock:
                self._agent.fetch_remote_metadata(name)
            deadline = time.monotonic() + timeout_s
            while not self._agent.check_remote_metadata(name):
                if time.monotonic() > deadline:
                    raise TransferError(
                        TransferKind.PEER_UNKNOWN,
                        f"agent {name} not in NIXL's etcd namespace "
                        f"{self.cfg.etcd_namespace} within {timeout_s:.1f}s",
                    )
                time.sleep(0.002)
        except TransferError:
            raise
        except Exception as e:
            raise _translate(e, "fetch_remote_metadata") from None
        # Loaded again: no longer stale (a peer evicted, then handshaken again, keeps its name).
        with self._lock:
            self._remotes.add(name)
            self._removed.discard(name)
        return name

    # ------------------------------------------------------------------ peers
    def add_remote(self, metadata: bytes) -> str:
        # NIXL may crash on malformed metadata instead of raising: refuse what is plainly not
        # a serialized agent before NIXL parses it.
        if not metadata.startswith(_AGENT_MD_MAGIC):
            raise TransferError(
                TransferKind.BAD_METADATA, "add_remote_agent: not NIXL agent metadata"
            )
        try:
            with self._md_lock:
                name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise _translate(e, "add_remote_agent") from None
        text = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._remotes.add(text)
            self._removed.discard(text)
        return text

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._remotes.discard(name)
            self._removed.add(name)
            if len(self._removed) > 4096:  # bounded: the oldest names matter least
                self._removed.pop()
        try:
            with self._md_lock:
                self._agent.remove_remote_agent(name)
        except Exception as e:
            log.debug("remove_remote_agent(%s) failed: %s", name, e)

    def drop_remote_under(self, name: str) -> None:
        """Fault injection (tests): NIXL forgets ``name`` while kvpush still holds it (as a
        connection lost under an established peer); the adapter's own account is untouched."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            log.debug("drop_remote_under(%s) failed: %s", name, e)

    def remote_agents(self) -> list[str]:
        """The remote agents loaded now (added and not removed), by this adapter's account."""
        with self._lock:
            return sorted(self._remotes)

    def _not_stale(self, name: str, what: str) -> None:
        """Refuse (and count) a call towards an agent this adapter removed."""
        with self._lock:
            stale = name in self._removed
            if stale:
                self.stale_agent_uses += 1
        if stale:
            raise TransferError(
                TransferKind.PEER_UNKNOWN,
                f"{what}: agent {name} was removed (stale)",
                "stale_agent",
            )

    def make_connection(self, name: str) -> None:
        try:
            with self._md_lock:
                self._agent.make_connection(name)
        except Exception as e:
            raise _translate(e, "make_connection") from None

    def prep_local(self, descs: np.ndarray, mem_type: str) -> DList:
        try:
            h = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem_type)
        except Exception as e:
            raise _translate(e, "prep_xfer_dlist(local)") from None
        return DList(h, len(descs))

    def prep_remote(self, name: str, descs: np.ndarray, mem_type: str) -> DList:
        self._not_stale(name, "prep_xfer_dlist(remote)")
        try:
            h = self._agent.prep_xfer_dlist(name, descs, mem_type)
        except Exception as e:
            raise _translate(e, "prep_xfer_dlist(remote)") from None
        return DList(h, len(descs), name)

    def release_dlist(self, dl: DList) -> None:
        try:
            dl.handle.release()
        except Exception as e:  # pragma: no cover
            log.debug("release dlist failed: %s", e)

    # ------------------------------------------------------------------ transfers
    def post_write(
        self,
        local: DList,
        local_idx: Indices,
        remote: DList,
        remote_idx: Indices,
        notif: bytes,
    ) -> tuple[Xfer, XferState]:
        """Create and post a WRITE; returns the handle and its first state (DONE/PROC/ERR)."""
        if remote.remote:
            self._not_stale(remote.remote, "make_prepped_xfer")
        try:
            h = self._agent.make_prepped_xfer(
                "WRITE", local.handle, local_idx, remote.handle, remote_idx, notif
            )
        except Exception as e:
            raise _translate(e, "make_prepped_xfer") from None
        x = Xfer(h)
        try:
            st = _STATES[self._agent.transfer(h)]
        except Exception as e:
            self.release(x)
            raise _translate(e, "transfer") from None
        return x, st

    def state(self, x: Xfer) -> XferState:
        try:
            return _STATES[self._agent.check_xfer_state(x.handle)]
        except Exception as e:
            raise _translate(e, "check_xfer_state") from None

    def release(self, x: Xfer) -> bool:
        """Release a handle; False if NIXL refused (transfer still active and not cancellable)."""
        if x.released:
            return True
        try:
            x.handle.release()
        except Exception as e:
            log.debug("release xfer failed: %s", e)
            return False
        x.released = True
        return True

    def send_notif(self, name: str, msg: bytes) -> None:
        self._not_stale(name, "send_notif")
        try:
            self._agent.send_notif(name, msg)
        except Exception as e:
            raise _translate(e, "send_notif") from None

    def get_notifs(self) -> dict[str, list[bytes]]:
        try:
            return dict(self._agent.get_new_notifs())
        except Exception as e:
            raise _translate(e, "get_new_notifs") from None

    def close(self) -> None:
        self.deregister()
