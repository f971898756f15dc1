"""Which lane carries a peer's KV: UCX's own protocol-selection report, read where UCX writes it.

Enabling (``creating``, around every NIXL agent's creation in ``kvpush.transport.nixl``): with
lanes on (``--lanes``, the default of ``serve-*``), agents are created with ``UCX_PROTO_INFO=y``
and UCX's log goes to ``UCX_LOG_FILE=<a private temp dir>/ucx.%p.log``, so UCX prints its tables
into that file and never onto stdout (where they would corrupt ``-o json``). UCX reads its log
file's name once, when its library loads (the first agent's creation, or earlier: ``probe``
reads UCX's version first and calls ``prepare`` before that), and ``UCX_PROTO_INFO`` at each
agent's creation: each is in the environment only until then, so no child process inherits
them; if UCX was loaded before kvpush could name the file, lanes stay off (the tables would go
to stdout). Once UCX has created the file this process opens it, then removes it and its
directory: nothing is left behind, even by an ``os._exit``. An operator who set
``UCX_LOG_FILE`` or ``UCX_PROTO_INFO`` keeps them untouched; lanes then come from their file
(``%p``/``%h`` expanded; only this process's lines) if it is readable and UCX_PROTO_INFO is y.
Every other line of kvpush's own file is one of UCX's log lines: it is relayed to kvpush's log
(warnings and errors at WARNING), so nothing UCX says is lost.

What the tables say (``kvpush.transport.protoinfo``; as data: ``kvpush.transport.lanebook``):
per NIXL agent (UCX worker) and endpoint
configuration (``cfg#N``, one per set of transports a peer is reached by, not one per peer): its
locality and which transports/devices carry ``ucp_put*`` (the WRITE) and ``ucp_am_send*``
(NIXL's notifications). A configuration's tables are printed once, when UCX first wires up an
endpoint of it -- measured here with NIXL 1.5.1's UCX 1.23: when the peer's first message
reaches this agent, or when this agent loads the peer's agent, i.e. before the first WRITE --
and later variants (``ucp_put*(multi)``) at their first use.

Attribution to a peer (the tables name no peer): each ``LaneBook`` (one per local agent) knows
each peer agent's first contact -- the wall time of the first notification this agent received
from it or of its first WRITE posted to it, whichever came first (measured: 30-80 ms after
the table it caused on a slow shared host, ~6 ms on a quiet one). A newly printed configuration,
taken in the order of the tables' timestamps T, is attributed to a peer when that peer's first
contact is the only one, among the peers not attributed yet, within [T - ``SLACK_S``, T +
``WINDOW_S``] (0.05 s, 2 s), or the only one at or after T (a contact follows the table it
caused: one stamped in the slack before T belongs to an earlier table -- two pairs checked one
after the other, 50 ms apart); repeated until nothing changes (a peer attributed to one table
leaves the others' windows). Any other peer -- one that reused an existing configuration (no new
table), or one whose window it shared -- is assigned a configuration when exactly one known
configuration has the peer's locality (same host -> intra-node, else inter-node), counting only
those printed by the peer's first contact when there are any (one printed later was made by a
later peer); otherwise its lane is ambiguous and the candidates are listed (``ambiguous:
cfg#1|cfg#2``). If no table ever appears (lanes off, or a UCX that prints none) the lane is
``unknown`` with the reason.

Threads: ``creating`` on the thread that creates an agent (under NIXL's creation lock);
``LaneBook.contact`` on the owner thread (a dict insert, once per peer); reading the file
(``LaneLog.refresh``, under its lock) and ``LaneBook.lanes`` on whichever thread takes a
telemetry snapshot -- never on a writer or receiver pass.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from kvpush.transport.lanebook import (
    EVIDENCE_UCX,
    EpConfig,
    Lane,
    LaneBook,
    attribute,
    resolve,
    unknown,
)
from kvpush.transport.protoinfo import Message, ProtoInfoParser, TableRow

__all__ = [
    "EVIDENCE_UCX",
    "EpConfig",
    "Lane",
    "LaneBook",
    "LaneLog",
    "attribute",
    "book_for",
    "creating",
    "describe",
    "prepare",
    "refresh",
    "resolve",
    "unknown",
]

log = logging.getLogger(__name__)

_READ_CHUNK = 4 << 20  # bytes read per refresh at most (the rest next time)
_RELAY_MAX = 100  # UCX lines relayed per refresh at most
_LEVEL = re.compile(r"\bUCX\s+(FATAL|ERROR|WARN|DIAG|INFO|DEBUG|TRACE\w*|PRINT)\b")


# --------------------------------------------------------------------------- the process's log


class LaneLog:
    """The UCX log file of this process: read incrementally, its tables kept by agent."""

    def __init__(self, path: str, *, own: bool, problem: str = "") -> None:
        self.path = path  # with %p and %h expanded
        self.own = own  # kvpush's private file (removed once open; its other lines relayed)
        self._problem = problem  # why no table can come (the operator's settings)
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._parser = ProtoInfoParser()
        self._configs: dict[tuple[str, int], EpConfig] = {}
        self._pid = os.getpid()
        self._unreadable = ""

    def attach(self) -> None:
        """Open the file once UCX made it; kvpush's own is then removed (the open handle reads
        on). Called after each agent's creation and again on each refresh until open."""
        with self._lock:
            self._attach()

    def _attach(self) -> None:
        if self._file is not None:
            return
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - held for the process's life
        except OSError as e:
            self._unreadable = f"{self.path} is not readable: {e.strerror or e}"
            return
        self._unreadable = ""
        if self.own:
            _remove_dir(os.path.dirname(self.path))

    def problem(self) -> str:
        """Why lanes cannot come from this file ("" when they can)."""
        return self._problem or self._unreadable

    def refresh(self) -> None:
        """Read what UCX wrote since the last call (bounded), keep its tables, relay the rest."""
        with self._lock:
            self._attach()
            if self._file is None:
                return
            try:
                data = self._file.read(_READ_CHUNK)
            except OSError as e:
                self._unreadable = f"{self.path}: {e.strerror or e}"
                return
            if not data:
                return
            relayed = 0
            for ev in self._parser.feed(data.decode("utf-8", "replace")):
                if ev.pid is not None and ev.pid != self._pid:
                    continue  # another process's lines (an operator's shared file)
                if isinstance(ev, TableRow):
                    self._table_row(ev)
                elif self.own:
                    if relayed < _RELAY_MAX:
                        _relay(ev)
                    relayed += 1
            if relayed > _RELAY_MAX:
                log.warning("UCX: %d more lines of its log not relayed", relayed - _RELAY_MAX)

    def _table_row(self, ev: TableRow) -> None:
        if ev.locality == "self":
            return  # NIXL's own loopback endpoint
        key = (ev.worker, ev.index)
        c = self._configs.get(key)
        if c is None:
            c = self._configs[key] = EpConfig(ev.worker, ev.locality, ev.index, ev.ts)
        c.add(ev)

    def configs(self, worker: str) -> list[EpConfig]:
        with self._lock:
            return [c for (w, _), c in self._configs.items() if w == worker]


def _relay(ev: Message) -> None:
    """One of UCX's own lines to kvpush's log, at its level (warnings and worse at WARNING)."""
    m = _LEVEL.search(ev.text)
    level = m[1] if m else "WARN"
    if level == "INFO":
        log.info("UCX: %s", ev.text)
    elif level.startswith(("DEBUG", "TRACE")):
        log.debug("UCX: %s", ev.text)
    else:
        log.warning("UCX: %s", ev.text)


def _remove_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path)


# --------------------------------------------------------------------------- enabling


@dataclass
class _Process:
    """What this process decided at ``prepare`` or its first agent's creation."""

    log: LaneLog | None
    reason: str  # why there is no log ("" when there is one)
    workers_on: set[str] = field(default_factory=set)  # agents created with the tables on
    log_env: str | None = None  # the UCX_LOG_FILE kvpush set, until the first agent read it
    saved_env: str | None = None  # the operator's value before (None: unset)


_state: _Process | None = None
_state_lock = threading.Lock()


def _ucx_loaded() -> bool:
    """Whether UCX is loaded in this process already (its log file was chosen at its load)."""
    try:
        with open("/proc/self/maps") as f:
            return any("/libucs" in line for line in f)
    except OSError:
        return False


def _operator_log() -> _Process | None:
    """The operator's own UCX_LOG_FILE / UCX_PROTO_INFO, when set (never touched)."""
    path = os.environ.get("UCX_LOG_FILE")
    info = os.environ.get("UCX_PROTO_INFO")
    if path is None and info is None:
        return None
    if path is None:
        return _Process(None, "UCX_PROTO_INFO is set without UCX_LOG_FILE: UCX prints to stdout")
    problem = "" if (info or "").lower() in ("y", "yes", "on", "1") else "UCX_PROTO_INFO is not y"
    expanded = path.replace("%p", str(os.getpid())).replace("%h", socket.gethostname())
    return _Process(LaneLog(expanded, own=False, problem=problem), "")


def _first(on: bool) -> _Process:
    operator = _operator_log()
    if operator is not None:
        return operator
    if not on:
        return _Process(None, "lanes were off when this process's first NIXL agent started")
    if _ucx_loaded():
        # Its log already goes to stdout: the tables would go there too.
        return _Process(None, "UCX was loaded before kvpush could send its log to a file")
    folder = tempfile.mkdtemp(prefix="kvpush-lanes-")
    atexit.register(_remove_dir, folder)  # (removed at once when its file is open)
    st = _Process(LaneLog(os.path.join(folder, f"ucx.{os.getpid()}.log"), own=True), "")
    st.saved_env = os.environ.get("UCX_LOG_FILE")
    st.log_env = os.environ["UCX_LOG_FILE"] = os.path.join(folder, "ucx.%p.log")
    return st


def prepare(on: bool = True) -> None:
    """Decide this process's lanes now -- before anything loads UCX (a command that reads
    UCX's version first, as ``probe`` does) -- rather than at the first agent's creation."""
    global _state
    with _state_lock:
        if _state is None:
            _state = _first(on)


@contextlib.contextmanager
def creating(on: bool, worker: str) -> Iterator[None]:
    """Around the creation of the NIXL agent ``worker`` (``on``: with lanes). Sets what UCX
    reads at that moment -- kvpush's own settings only -- and takes it out again after."""
    prepare(on)
    st = _state
    assert st is not None
    ours = on and st.log is not None and st.log.own
    saved = os.environ.get("UCX_PROTO_INFO")
    if ours:
        os.environ["UCX_PROTO_INFO"] = "y"
    try:
        yield
    finally:
        if ours:
            _restore("UCX_PROTO_INFO", saved)
        if st.log_env is not None:  # UCX has read its log file's name: no child inherits it
            if os.environ.get("UCX_LOG_FILE") == st.log_env:
                _restore("UCX_LOG_FILE", st.saved_env)
            st.log_env = None
    if st.log is not None and (ours or not st.log.own):
        st.workers_on.add(worker)
        st.log.attach()


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def book_for(worker: str, lanes_on: bool) -> LaneBook:
    """The lane book of the local agent ``worker`` (created with lanes ``lanes_on``)."""
    st = _state
    if not lanes_on:
        return LaneBook(worker, None, "lanes are off (--no-lanes)")
    if st is None:
        return LaneBook(worker, None, "no NIXL agent was created in this process")
    if st.log is None:
        return LaneBook(worker, None, st.reason)
    if worker not in st.workers_on:
        return LaneBook(worker, None, "this agent was created without UCX_PROTO_INFO")
    return LaneBook(worker, st.log, "")


def describe() -> tuple[str, bool]:
    """Where this process's lanes come from, for a person; True when they cannot come."""
    st = _state
    if st is None:
        return "no NIXL agent was created in this process", True
    if st.log is None:
        return st.reason, True
    if st.log.own:
        return "from UCX's own report (UCX_PROTO_INFO, into a private log file)", False
    problem = st.log.problem()
    if problem:
        return problem, True
    return f"from UCX_LOG_FILE {st.log.path} (set by the operator)", False


def refresh() -> None:
    """Read the process's UCX log now (relaying UCX's own lines); a no-op without one."""
    st = _state
    if st is not None and st.log is not None:
        st.log.refresh()
