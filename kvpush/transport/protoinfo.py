"""UCX's protocol-selection tables (``UCX_PROTO_INFO=y``) as data: an incremental, total parser.

UCX prints one table per endpoint configuration and operation, each line prefixed with
``[unixtime] [host:pid:thread]``::

    [1796486942.707321] [vm:31841:1]   +--------+-------------+-----------------------------------+
    [1796486942.707321] [vm:31841:1]   | p-44dd2ca8d47d#213683208139 intra-node cfg#1             |
    [1796486942.707321] [vm:31841:1]   | remote memory write by ucp_put* from host memory to host |
    [1796486942.707321] [vm:31841:1]   +--------+-------------+-----------------------------------+
    [1796486942.707321] [vm:31841:1]   | Range  | Description |              Config               |
    [1796486942.707321] [vm:31841:1]   +--------+-------------+-----------------------------------+
    [1796486942.707321] [vm:31841:1]   | 0..inf | zero-copy   | 52% on tcp/lo and 48% on tcp/eth0 |

The title names the UCX worker (a NIXL agent's name), the configuration's locality (``self``,
``intra-node``, ``inter-node``) and its index (``cfg#N``, per worker); the second line the
operation (``ucp_put*``: a WRITE; ``ucp_am_send*``: an active message, which is how NIXL sends
its notifications); each row a message-size range and the transports/devices that carry it
(``cma/memory``, ``tcp/lo``, ``rc_mlx5/mlx5_0:1``, ``cuda_ipc/cuda``...). Any other line of the
file is one of UCX's own log lines (a warning, an error).

``ProtoInfoParser.feed`` takes the file's text in arbitrary chunks (a partial last line waits
for the next chunk) and returns what the complete lines said: ``TableRow`` for each row of a
table, ``Message`` for any other line. Lines of several threads may interleave: a table's state
is kept per ``host:pid:thread``. Total: any text yields events or nothing, never an exception.
Pure (no I/O, no threads); its owner (``kvpush.transport.lanes``) serialises calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

#: The kinds of operation a table is about (``Operation``: what kvpush cares for).
WRITE: Final = "write"  # ucp_put*: NIXL's WRITE
NOTIF: Final = "notif"  # ucp_am_send*: NIXL's notifications (active messages)
OTHER: Final = "other"

LOCALITIES: Final = ("self", "intra-node", "inter-node")

_PREFIX = re.compile(
    r"^\[(?P<ts>\d{1,12}(?:\.\d{1,9})?)\]\s+\[(?P<who>[^\]]{0,512})\]\s?(?P<body>.*)$"
)
_TITLE = re.compile(
    r"^(?P<worker>\S(?:.*?\S)?)\s+(?P<loc>self|intra-node|inter-node)\s+cfg#(?P<idx>\d{1,6})\b"
)
_SIZE = r"\d{1,20}(?:\.\d{1,6})?[KMGTP]?"
_RANGE = re.compile(rf"^(?P<lo>{_SIZE})B?(?:\s*\.\.\s*(?P<hi>inf|{_SIZE})B?)?$")
_HOP = re.compile(r"([A-Za-z][A-Za-z0-9_]{0,63})/([A-Za-z0-9_.:\-]{1,128})")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_MAX_LINE = 1 << 16  # longer "lines" (a file with no newline) are cut, never buffered whole


@dataclass(frozen=True)
class Row:
    """One row of a table: messages of ``lo``..``hi`` bytes (``hi`` None: no bound) go over
    ``hops`` (``(transport, device)`` pairs, in UCX's order)."""

    lo: int
    hi: int | None
    description: str
    hops: tuple[tuple[str, str], ...]

    def covers(self, size: int) -> bool:
        return self.lo <= size and (self.hi is None or size <= self.hi)


@dataclass(frozen=True)
class TableRow:
    """A row of the table of ``worker``'s configuration ``index`` for ``operation``."""

    ts: float  # the table's UCX timestamp (wall clock)
    pid: int | None
    worker: str
    locality: str
    index: int
    operation: str  # WRITE, NOTIF or OTHER
    title: str  # UCX's words for the operation
    row: Row


@dataclass(frozen=True)
class Message:
    """A line that is no part of a table: UCX's own log line (or text of unknown origin)."""

    ts: float | None
    pid: int | None
    text: str


Event = TableRow | Message


@dataclass
class _Table:
    ts: float
    worker: str
    locality: str
    index: int
    title: str = ""  # the operation line, once seen


def operation_of(title: str) -> str:
    """``WRITE`` for a ``ucp_put*`` table, ``NOTIF`` for ``ucp_am_send*``, else ``OTHER``."""
    if "ucp_put" in title:
        return WRITE
    if "ucp_am_send" in title:
        return NOTIF
    return OTHER


def parse_size(text: str) -> int | None:
    """``"8184"`` -> 8184, ``"8K"`` -> 8192; None for ``"inf"`` or anything else."""
    m = re.fullmatch(r"(\d{1,20}(?:\.\d{1,6})?)([KMGTP]?)B?", text.strip())
    if m is None:
        return None
    return int(float(m[1]) * _UNITS[m[2]])


def parse_range(text: str) -> tuple[int, int | None] | None:
    """``"0..inf"`` -> (0, None); ``"1..16515"`` -> (1, 16515); ``"0"`` -> (0, 0)."""
    m = _RANGE.match(text.strip())
    if m is None:
        return None
    lo = parse_size(m["lo"])
    if lo is None:
        return None
    if m["hi"] is None:
        return lo, lo
    return lo, None if m["hi"] == "inf" else parse_size(m["hi"])


def parse_hops(config: str) -> tuple[tuple[str, str], ...]:
    """``"52% on tcp/lo and 48% on tcp/eth0"`` -> (("tcp", "lo"), ("tcp", "eth0"))."""
    return tuple((tl, dev) for tl, dev in _HOP.findall(config))


def _pid(who: str) -> tuple[str, int | None]:
    """``"host:pid:thread"`` -> (the whole, as the table's key; the pid when it reads as one)."""
    parts = who.rsplit(":", 2)
    pid: int | None = None
    if len(parts) == 3:
        try:
            pid = int(parts[1].strip())
        except ValueError:
            pid = None
    return who.strip(), pid


class ProtoInfoParser:
    """Feed it the log's text as it grows; it returns the events of each complete line."""

    def __init__(self) -> None:
        self._tail = ""
        self._tables: dict[str, _Table] = {}  # by host:pid:thread

    def feed(self, text: str) -> list[Event]:
        lines = (self._tail + text).split("\n")
        self._tail = lines.pop()[-_MAX_LINE:]
        out: list[Event] = []
        for line in lines:
            ev = self.line(line[:_MAX_LINE])
            if ev is not None:
                out.append(ev)
        return out

    def flush(self) -> list[Event]:
        """The events of a last line that has no newline yet (at the end of a file)."""
        tail, self._tail = self._tail, ""
        ev = self.line(tail)
        return [ev] if ev is not None else []

    def line(self, raw: str) -> Event | None:
        """The event of one line, or None (a border, a column header, an empty line)."""
        text = raw.rstrip("\r")
        m = _PREFIX.match(text)
        if m is None:
            body = text.strip()
            return Message(None, None, body) if body else None
        ts = float(m["ts"])
        who, pid = _pid(m["who"])
        body = m["body"].strip()
        if not body:
            return None
        if body.startswith("+") and set(body) <= {"+", "-"}:
            return None  # a border
        if body.startswith("|") and body.endswith("|") and len(body) >= 2:
            return self._cells(ts, who, pid, [c.strip() for c in body[1:-1].split("|")])
        return Message(ts, pid, body)

    def _cells(self, ts: float, who: str, pid: int | None, cells: list[str]) -> Event | None:
        if len(cells) == 1:
            self._title(ts, who, cells[0])
            return None
        table = self._tables.get(who)
        if len(cells) != 3 or table is None or not table.title or cells[0] == "Range":
            return None
        span = parse_range(cells[0])
        if span is None:
            return None
        row = Row(span[0], span[1], cells[1], parse_hops(cells[2]))
        return TableRow(
            table.ts,
            pid,
            table.worker,
            table.locality,
            table.index,
            operation_of(table.title),
            table.title,
            row,
        )

    def _title(self, ts: float, who: str, cell: str) -> None:
        """A one-cell line: a table's title (worker, locality, cfg#) or its operation."""
        m = _TITLE.match(cell)
        if m is not None:
            self._tables[who] = _Table(ts, m["worker"], m["loc"], int(m["idx"]))
            if len(self._tables) > 256:  # bounded: threads come and go
                self._tables.pop(next(iter(self._tables)))
            return
        table = self._tables.get(who)
        if table is not None and not table.title:
            table.title = cell
