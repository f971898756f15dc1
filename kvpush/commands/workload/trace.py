"""Request traces in the Mooncake format: one JSON object per line, read and checked.

The format (kvcache-ai/Mooncake ``FAST25-release``; AIPerf, SGLang's ``bench_serving`` and
Dynamo's replay read it): ``{"timestamp": <ms since the trace's start>, "input_length":
<prompt tokens>, "output_length": <tokens generated>, "hash_ids": [<one id per 512-token
block; equal ids = a reusable prefix>]}``. Other keys are ignored.

Owns ``TraceRequest`` (one valid line), ``Problem`` (one line that is not: its number and what
is wrong, said in one line), ``decode_line`` (pure: a line -> a request, a problem, or None for
a blank line), ``read`` (the lines of a stream, in order; a bad line is a problem and the rest
goes on) and ``load`` (a whole file or stdin, with ``--start-at`` and ``--limit``: refused only
where nothing can start -- an unreadable file, no valid request). A line is a problem when it
is no JSON object, a field is missing, not a number, negative (``input_length`` 0 too: nothing
to push), or its timestamp is earlier than the previous valid request's (out of order).

Pure functions and a reader on the caller's thread.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvpush.errors import ConfigError

#: A line longer than this is a problem (not parsed): a trace line is a few KiB at most.
MAX_LINE_CHARS = 1 << 20
#: A number beyond this (2**53: a double's exact integers) is a problem, not a request.
MAX_NUMBER = 1 << 53
#: The Mooncake format's prefix block (what one ``hash_ids`` entry stands for).
HASH_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    line: int  # 1-based line number in its file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()

    def to_json(self) -> str:
        """The request as one line of the format (``timestamp`` as an integer when it is one)."""
        ts = int(self.timestamp_ms) if float(self.timestamp_ms).is_integer() else self.timestamp_ms
        return json.dumps(
            {
                "timestamp": ts,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


@dataclass(frozen=True)
class Problem:
    line: int
    what: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}: skipped"


def _number(obj: dict[str, object], key: str, *, integer: bool, least: int) -> float | str:
    """``obj[key]`` as a number at least ``least``, or what is wrong with it."""
    if key not in obj:
        return f"no {key}"
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        return f"{key} is not a number ({_short(v)})"
    if isinstance(v, int) and abs(v) > MAX_NUMBER:
        return f"{key} {_short(v)} is too large"
    if not math.isfinite(v):
        return f"{key} is {v}"
    if integer and not float(v).is_integer():
        return f"{key} {v} is not a whole number of tokens"
    if v < 0:
        return f"{key} {v:g} is negative"
    if v < least:
        return f"{key} {v:g} is below {least}"
    return float(v)


#: What one line decodes to: a request, a problem, or nothing (a blank line).
Decoded = TraceRequest | Problem | None


def _short(v: object) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _hash_ids(obj: dict[str, object]) -> tuple[int, ...] | str:
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list):
        return f"hash_ids is not a list ({_short(ids)})"
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
        return "hash_ids holds something other than non-negative integers"
    return tuple(int(x) for x in ids)


def decode_line(
    text: str, line: int, last_ms: float | None = None
) -> TraceRequest | Problem | None:
    """One line: a request, a problem (``last_ms``: the previous valid request's timestamp, for
    order), or None when the line is blank."""
    if len(text) > MAX_LINE_CHARS:
        return Problem(line, f"{len(text):,} characters, more than a trace line holds")
    text = text.strip()
    if not text:
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        return Problem(line, f"not JSON ({str(e).split(':')[0]})")
    if not isinstance(obj, dict):
        return Problem(line, f"not a JSON object ({type(obj).__name__})")
    ts = _number(obj, "timestamp", integer=False, least=0)
    n_in = _number(obj, "input_length", integer=True, least=1)
    n_out = _number(obj, "output_length", integer=True, least=0)
    ids = _hash_ids(obj)
    for got in (ts, n_in, n_out, ids):
        if isinstance(got, str):
            return Problem(line, got)
    assert isinstance(ts, float) and isinstance(n_in, float) and isinstance(n_out, float)
    assert isinstance(ids, tuple)
    if last_ms is not None and ts < last_ms:
        return Problem(
            line,
            f"timestamp {ts:g} ms is before the previous request's {last_ms:g} ms (out of order)",
        )
    return TraceRequest(line, ts, int(n_in), int(n_out), ids)


def read(lines: Iterable[str]) -> Iterator[TraceRequest | Problem]:
    """The requests and problems of ``lines``, in order (blank lines are passed over)."""
    last: float | None = None
    for n, text in enumerate(lines, start=1):
        got = decode_line(text, n, last)
        if isinstance(got, TraceRequest):
            last = got.timestamp_ms
        if got is not None:
            yield got


@dataclass(frozen=True)
class Workload:
    """What ``load`` kept: the requests to replay (from ``--start-at``, at most ``--limit``),
    the problems found on the way, and how many valid requests came before ``--start-at``."""

    source: str
    requests: tuple[TraceRequest, ...]
    problems: tuple[Problem, ...]
    before_start: int = 0
    start_at_s: float = 0.0


def open_source(source: str) -> TextIO:
    """``-`` (stdin) or a file, read as UTF-8 (bytes that are not become a problem line)."""
    if source == "-":
        return sys.stdin
    try:
        return Path(source).open(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(
            f"cannot read the workload {source!r}: {e.strerror or e}",
            "give a Mooncake-format trace (JSON lines), or - for stdin; "
            "'kvpush workload synth' writes one",
        ) from None


def load(
    source: str,
    *,
    limit: int | None = None,
    start_at_s: float = 0.0,
    on_problem: Callable[[Problem], None] | None = None,
) -> Workload:
    """The requests of ``source`` from ``start_at_s`` into the trace, at most ``limit`` of them;
    each bad line a ``Problem`` (also handed to ``on_problem`` as it is found). Refused
    (``ConfigError``) when the source cannot be read or holds no request to replay."""
    kept: list[TraceRequest] = []
    problems: list[Problem] = []
    before = 0
    start_ms = start_at_s * 1000.0
    stream = open_source(source)
    try:
        for got in read(stream):
            if isinstance(got, Problem):
                problems.append(got)
                if on_problem is not None:
                    on_problem(got)
            elif got.timestamp_ms < start_ms:
                before += 1
            else:
                kept.append(got)
                if limit is not None and len(kept) >= limit:
                    break
    except OSError as e:
        raise ConfigError(f"cannot read the workload {source!r}: {e.strerror or e}") from None
    finally:
        if stream is not sys.stdin:
            stream.close()
    if not kept:
        raise _nothing(source, problems, before, start_at_s)
    return Workload(source, tuple(kept), tuple(problems), before, start_at_s)


def _nothing(source: str, problems: list[Problem], before: int, start_at_s: float) -> ConfigError:
    name = "stdin" if source == "-" else repr(source)
    if before:
        return ConfigError(
            f"the workload {name} has no request at or after --start-at {start_at_s:g} s "
            f"({before} before it)",
            "give an earlier --start-at",
        )
    first = f": {problems[0]}" if problems else ""
    return ConfigError(
        f"the workload {name} holds no valid request ({len(problems)} bad lines{first})",
        'each line is one JSON object: {"timestamp": MS, "input_length": TOKENS, '
        '"output_length": TOKENS, "hash_ids": [...]}',
    )
