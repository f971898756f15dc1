"""What a request's spans say, as plain data: the span of one side and its phase steps.

Owns ``SpanSpec`` (one request's span on one side: name, start and end on the wall clock,
``kvpush.*`` attributes, how it ended, the W3C context it joins) and ``Step`` (one child span:
the step between two phase stamps), the step chains of D and P (``D_CHAIN``, ``P_CHAIN``: the
phases ``kvpush.telemetry.phases`` stamps, each step named after what happens in it) and
``steps``, which turns a request's stamps into its child spans, in order. Also the W3C
``traceparent`` helpers (``parse_traceparent``, ``sampled``, ``format_traceparent``).

Pure: no OpenTelemetry import, no threads, no I/O. The roles build a ``SpanSpec`` on the
tracing thread (``kvpush.telemetry.tracing``), never on a writer or receiver thread.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvpush.telemetry import phases as ph

AttrValue = str | int | float | bool

#: P: its blocks were filled and handed to the writer (the prefill leg's answer); not one of
#: ``Phase`` (no histogram times it), but where P's span splits its own work from the push.
BLOCKS_FINISHED = "blocks_finished"
#: A step's start that is the span's own start (the request arrived).
START = ""

# Span names: one span per request and side, as the field names its proxy and engine spans
# (llm-d's ``llm_d.pd_proxy.request|prefill|decode``, vLLM's ``llm_request``).
REQUEST = "kvpush.request"  # drive or leg: the client
PREFILL = "kvpush.prefill"  # P: the server
DECODE = "kvpush.decode"  # D: the server

#: (child span name, the phases it starts at (the first stamped), the phase it ends at).
Chain = tuple[tuple[str, tuple[str, ...], str], ...]

D_CHAIN: Chain = (
    (f"{DECODE}.allocate", (START,), ph.D_ALLOCATED),
    (f"{DECODE}.register", (ph.D_ALLOCATED,), ph.PUSH_REG_SENT),
    (f"{DECODE}.push_wait", (ph.PUSH_REG_SENT,), ph.COMPLETION_RECEIVED),
    (f"{DECODE}.verify", (ph.COMPLETION_RECEIVED,), ph.VERIFIED),
    (f"{DECODE}.answer", (ph.VERIFIED, ph.COMPLETION_RECEIVED), ph.ANSWERED),
)
P_CHAIN: Chain = (
    (f"{PREFILL}.fill", (START,), BLOCKS_FINISHED),
    (f"{PREFILL}.match_wait", (BLOCKS_FINISHED,), ph.REGISTRATION_MATCHED),
    (f"{PREFILL}.handshake_wait", (ph.REGISTRATION_MATCHED,), ph.HANDSHAKE_DONE),
    (f"{PREFILL}.post", (ph.HANDSHAKE_DONE,), ph.WRITE_POSTED),
    (f"{PREFILL}.write", (ph.WRITE_POSTED,), ph.WRITE_DONE),
)
#: P's failed push carries no stamps past its blocks: its last step is the whole push.
P_PUSH = f"{PREFILL}.push"


@dataclass(frozen=True)
class Step:
    """One child span: from ``t0`` to ``t1`` (wall clock); ``phase``: the stamp it ends at
    ("" for the step a request failed in); ``error``: the reason it failed there."""

    name: str
    t0: float
    t1: float
    phase: str = ""
    error: str = ""


@dataclass(frozen=True)
class SpanSpec:
    """One request's span on one side. ``error``: the reason it failed ("" = ok), ``detail``
    beside it; ``traceparent``/``tracestate``: the W3C context it joins ("" = a new trace)."""

    name: str
    t0: float
    t1: float
    attrs: Mapping[str, AttrValue]
    steps: tuple[Step, ...] = ()
    error: str = ""
    detail: str = ""
    traceparent: str = ""
    tracestate: str = ""

    @property
    def spans(self) -> int:
        return 1 + len(self.steps)


def endpoint_attrs(
    role: str, engine_id: str, address: str, tp_size: int, wire: str
) -> dict[str, AttrValue]:
    """What every span of an endpoint says about it (the resource names the process)."""
    return {
        "kvpush.role": role,
        "kvpush.engine_id": engine_id,
        "kvpush.address": address,
        "kvpush.tp_size": tp_size,
        "kvpush.wire": wire,
    }


def attributes(values: Mapping[str, AttrValue | None]) -> dict[str, AttrValue]:
    """``values`` without the empty ones (an attribute with no value says nothing)."""
    return {k: v for k, v in values.items() if v is not None and v != ""}


def steps(
    chain: Chain,
    t0: float,
    stamps: Mapping[str, float],
    t1: float,
    error: str = "",
    failed_name: str = "",
) -> tuple[Step, ...]:
    """The child spans of a request that started at ``t0`` and ended at ``t1``: one per step of
    ``chain`` whose two ends are stamped, in order (a step whose start never happened -- no
    verification -- is left out). A failed request (``error``) ends with the step it failed
    in: from its start to ``t1``, named ``failed_name`` when given. Steps never overlap: each
    starts no earlier than the one before it ended and ends no earlier than it starts (P's
    blocks may be matched a moment before its prefill leg's own stamp says they were filled;
    the stamps of two clocks may be microseconds apart)."""
    out: list[Step] = []
    floor = t0
    for name, froms, to in chain:
        start = next(
            (t for t in (t0 if f == START else stamps.get(f) for f in froms) if t is not None),
            None,
        )
        if start is None:
            continue
        start = max(start, floor)
        end = stamps.get(to)
        if end is None:
            if error:
                out.append(Step(failed_name or name, start, max(start, t1), "", error))
                break
            continue
        floor = max(start, end)
        out.append(Step(name, start, floor, to))
    return tuple(out)


_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


@dataclass(frozen=True)
class Parent:
    """A W3C ``traceparent``'s parts."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse_traceparent(text: str) -> Parent | None:
    """``text``'s parts; None when it is no valid W3C traceparent (version ff, an all-zero id,
    a version 00 with more fields)."""
    m = _TRACEPARENT.match(text.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or not int(trace_id, 16):
        return None
    if not int(span_id, 16):
        return None
    return Parent(trace_id, span_id, int(flags, 16))


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def sampled(traceparent: str) -> bool:
    """Whether a request with this ``traceparent`` is to be traced: yes without one (a trace
    starts here, sampled at the ratio) and with a sampled one; no when its caller did not
    sample it. Cheap (the hot path asks): only the flags are read."""
    if len(traceparent) < 55 or traceparent[52] != "-":
        return True  # none, or not W3C's: a new trace starts here
    try:
        return bool(int(traceparent[53:55], 16) & 1)
    except ValueError:
        return True
