"""``--endpoints FILE|-`` and ``--peer HOST:PORT[=ROLE]``: the fleet an operator lists by hand.

Owns ``Entry`` (one listed endpoint: its address, the role and TP size the list gives it, where
it was listed) and ``read_entries`` (every entry of the files and ``--peer`` values, with one
``problem`` line for each bad one: the rest goes on). A line is ``HOST:PORT [prefill|decode]
[tp=N]`` (also ``p``/``d``, ``P``/``D``; ``#`` starts a comment) or a JSON object
``{"address": "HOST:PORT", "role": "decode", "tp": 2}``. The role and TP size matter for a
vLLM engine, whose metadata carries neither; a kvpush endpoint says its own (and a listed role
that contradicts it is a problem line). An entry listed twice keeps its first listing.

Pure parsing: the caller reads the file (``-``: stdin) on its own thread; no contact with any
endpoint (that is ``kvpush.commands.fleet.sight``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpush.address import format_address, parse_address
from kvpush.config import Role
from kvpush.errors import ConfigError

#: The longest listing read (lines); a longer file is cut there with a problem line.
MAX_ENTRIES = 10_000

_ROLES = {
    "prefill": Role.PREFILL,
    "p": Role.PREFILL,
    "decode": Role.DECODE,
    "d": Role.DECODE,
}


@dataclass(frozen=True)
class Entry:
    address: str  # HOST:PORT, canonical (format_address)
    role: Role | None = None  # as listed; None: the endpoint must say it
    tp_size: int | None = None  # as listed; None: the endpoint says it (vLLM: 1)
    where: str = ""  # "FILE:LINE" or "--peer"


@dataclass(frozen=True)
class Listing:
    entries: list[Entry]
    problems: list[str]  # one line each: where, what, and what was done about it


def _role(text: str, where: str) -> Role:
    role = _ROLES.get(text.strip().lower())
    if role is None:
        raise ConfigError(f"{where}: unknown role {text!r}", "use prefill or decode")
    return role


def _tp(text: object, where: str) -> int:
    n = int(text) if isinstance(text, int) or (isinstance(text, str) and text.isdigit()) else 0
    if not 1 <= n <= 4096:
        raise ConfigError(f"{where}: invalid tp size {text!r}", "use tp=N with N from 1 to 4096")
    return n


def _address(text: str, where: str) -> str:
    try:
        return format_address(*parse_address(text))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e.message}", e.hint) from None


def parse_line(line: str, where: str) -> Entry | None:
    """One listing line as an entry; None for a blank or comment line; ConfigError when bad."""
    text = line.split("#", 1)[0].strip() if not line.lstrip().startswith("{") else line.strip()
    if not text:
        return None
    if text.startswith("{"):
        return _json_entry(text, where)
    words = text.split()
    addr = _address(words[0], where)
    role: Role | None = None
    tp: int | None = None
    for w in words[1:]:
        if w.lower().startswith("tp="):
            tp = _tp(w[3:], where)
        else:
            role = _role(w, where)
    return Entry(addr, role, tp, where)


def _json_entry(text: str, where: str) -> Entry:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where}: not JSON ({e.msg})", 'e.g. {"address": "10.0.0.7:5600"}'
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("address"), str):
        raise ConfigError(
            f'{where}: a JSON line needs an "address" string', 'e.g. {"address": "10.0.0.7:5600"}'
        )
    role = obj.get("role")
    tp = obj.get("tp", obj.get("tp_size"))
    return Entry(
        _address(obj["address"], where),
        _role(role, where) if isinstance(role, str) else None,
        _tp(tp, where) if tp is not None else None,
        where,
    )


def parse_peer(value: str) -> Entry:
    """``--peer HOST:PORT[=ROLE]`` (ROLE prefill|decode, optionally ``,tp=N``)."""
    addr, _, rest = value.partition("=")
    words = [w for w in rest.replace(",", " ").split() if w]
    return parse_line(" ".join([addr, *words]), f"--peer {value}") or Entry(
        _address(addr, "--peer"), where="--peer"
    )


def read_lines(path: str) -> tuple[list[str], str | None]:
    """The lines of ``path`` (``-``: stdin), or a problem line when it cannot be read."""
    try:
        if path == "-":
            return sys.stdin.read().splitlines(), None
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines(), None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return [], f"{path}: cannot read the endpoint list ({why}): it is left out"


class _Collect:
    """The entries in listing order, each address once, with the problem lines."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.problems: list[str] = []
        self.seen: dict[str, str] = {}

    def add(self, e: Entry) -> None:
        if e.address in self.seen:
            self.problems.append(
                f"{e.where}: {e.address} is listed again ({self.seen[e.address]}): ignored"
            )
        elif len(self.entries) >= MAX_ENTRIES:
            self.problems.append(f"{e.where}: more than {MAX_ENTRIES} endpoints: left out")
        else:
            self.seen[e.address] = e.where
            self.entries.append(e)

    def file(self, path: str) -> None:
        lines, problem = read_lines(path)
        if problem:
            self.problems.append(problem)
        name = "stdin" if path == "-" else path
        for n, line in enumerate(lines, 1):
            try:
                e = parse_line(line, f"{name}:{n}")
            except ConfigError as err:
                self.problems.append(f"{err.message}: line ignored")
                continue
            if e is not None:
                self.add(e)

    def peer(self, value: str) -> None:
        try:
            self.add(parse_peer(value))
        except ConfigError as err:
            self.problems.append(f"{err.message}: ignored")


def read_entries(files: Sequence[str], peers: Iterable[str]) -> Listing:
    """Every entry of ``files`` and ``peers``, in order, duplicates dropped (problem lines say
    which were bad and why)."""
    c = _Collect()
    for path in files:
        c.file(path)
    for value in peers:
        c.peer(value)
    return Listing(c.entries, c.problems)
