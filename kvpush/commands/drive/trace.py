"""``drive --trace FILE``: where each request's time went, one JSON line per request.

Owns ``Tracer`` (behind ``Driver(tracer=...)``) and ``phase_stats``. Before the first request
the tracer measures each peer's clock offset over its side channel (as ``probe`` does:
``HandshakeReq`` round trips, ``remote_clock - (t_send + t_recv) / 2`` of the fastest; its
error is at most half that round trip). Each request's record holds:

* ``transfer_id``, ``index``, ``prefill``, ``decode``, ``outcome`` (ok / failed), ``reason``,
  ``detail``, ``latency_s`` (drive's, from sending the request to D's answer);
* ``phases``: phase name -> seconds since drive sent the request, on drive's clock: D's stamps
  from its answer (``DecodeRep.phases``) and P's from the push's outcome (``PushWaitRep``,
  asked once D answered, on P's executor: one more side-channel round trip per request),
  each shifted by its peer's clock offset (``kvpush.telemetry.phases`` names them and says
  which follow each other);
* ``ended_at`` for a failed request: the last phase it reached before it failed (``sent``: D
  never allocated blocks for it) -- with ``reason``, where and why it ended;
* ``clock_error_s``: the sum of both peers' offset errors (what the phases may be off by);
* ``phases_missing`` when a peer's phases came but are left out for want of its clock offset
  (it could not be measured): which peer and why -- never a silent gap.

A peer that joins mid-run (``drive --registry``, ``demo``'s extra D) has its offset measured
when it joins (``joined``, on the thread that adds it); one that cannot be measured is named in
the run's notes and in each record its phases are missing from.

The record is written once the request's result is known, its worker is done with it (so that
a late D answer still brings its phases) and P answered; at the end of the run ``close`` waits
up to ``CLOSE_WAIT_S`` for those, then writes what is left with what is known. Threads: drive's
workers (``begin``, ``sent``, ``repicked``, ``legs``, ``end``), P's executor (``_ask_p``), any
thread (``resolved``, ``joined``); records, offsets and the file under one lock.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NotRequired, TypedDict

from kvpush.commands.common import control
from kvpush.commands.common.results import RequestResult
from kvpush.commands.common.stats import percentile
from kvpush.commands.probe.report import rtt_stats
from kvpush.errors import ConfigError, KvpushError
from kvpush.telemetry import phases as ph
from kvpush.wire import protocol

log = logging.getLogger(__name__)

#: Round trips per peer for its clock offset.
OFFSET_SAMPLES = 5
#: At the end of the run, how long ``close`` waits for workers still busy with a request whose
#: result is known (a failed request's D answer may come after P was found dead).
CLOSE_WAIT_S = 5.0
#: How long drive waits for P's outcome of a push D answered ok (P notes it when its poll sees
#: the WRITE done, a moment after D's completion), and of one D answered as failed.
P_WAIT_OK_S = 2.0
P_WAIT_FAILED_S = 0.3


@dataclass(frozen=True)
class ClockOffset:
    offset_s: float  # remote clock - drive's clock
    error_s: float  # half the fastest round trip


def measure_offset(address: str, token: bytes | None, timeout_s: float) -> ClockOffset:
    """``address``'s clock offset from drive's (kvpush endpoints stamp ``server_clock`` with
    ``time.time()``)."""
    samples = []
    with control.connect(address, token, timeout_s) as client:
        client.identify(timeout_s=timeout_s)
        req = protocol.HandshakeReq(mode="notif", requester="kvpush-drive-trace")
        for _ in range(OFFSET_SAMPLES):
            t0 = time.time()
            rep = control.call(client, req)
            t1 = time.time()
            if isinstance(rep, protocol.HandshakeRep):
                samples.append((t0, t1, rep.server_clock))
    if not samples:
        raise KvpushError(f"{address} did not answer a handshake request")
    st = rtt_stats(samples)
    return ClockOffset(st.clock_offset_s, st.min_s / 2)


@dataclass
class _Rec:
    t_wall: float = 0.0  # drive's clock when the request was sent
    p: str = ""
    d: str = ""
    d_phases: dict[str, float] = field(default_factory=dict)
    p_phases: dict[str, float] = field(default_factory=dict)
    p_note: str = ""
    result: RequestResult | None = None
    active: bool = False  # a worker still handles it
    asking_p: bool = False  # P's phases asked for, no answer yet

    @property
    def complete(self) -> bool:
        return self.result is not None and not self.active and not self.asking_p


class TraceRecord(TypedDict):
    """One line of the trace file (as written; the summary's statistics read it back)."""

    transfer_id: str
    index: int
    outcome: str  # "ok" | "failed"
    reason: str
    detail: str
    prefill: str
    decode: str
    latency_s: float
    phases: dict[str, float]  # seconds since the request was sent, on this host's clock
    clock_error_s: float
    ended_at: NotRequired[str]  # a failed request's last phase reached
    p_note: NotRequired[str]
    phases_missing: NotRequired[str]


class Tracer:
    def __init__(self, path: Path, token: bytes | None = None, timeout_s: float = 5.0) -> None:
        try:
            self._f: IO[str] = path.open("w", buffering=1)
        except OSError as e:
            raise ConfigError(
                f"cannot write the trace file {str(path)!r}: {e.strerror or e}",
                "give --trace a path in a directory that exists and is writable",
            ) from None
        self.path = path
        self._token = token
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._recs: dict[int, _Rec] = {}
        self.offsets: dict[str, ClockOffset] = {}
        self._unmeasured: dict[str, str] = {}  # address -> why its offset is unknown
        self.records: list[TraceRecord] = []  # as written (for the summary's statistics)

    # ------------------------------------------------------------------ before the run
    def start(self, peers: Iterable[str]) -> list[str]:
        """Measure every peer's clock offset; notes for the peers that could not be measured
        (their phases are left out of the records, which say so)."""
        notes = []
        for a in dict.fromkeys(peers):
            note = self.joined(a, at_start=True)
            if note:
                notes.append(note)
        return notes

    def joined(self, address: str, at_start: bool = False) -> str | None:
        """Measure ``address``'s clock offset (once); a note when it cannot be."""
        with self._lock:
            if address in self.offsets or address in self._unmeasured:
                return None
        try:
            off = measure_offset(address, self._token, self._timeout_s)
        except KvpushError as e:
            when = "" if at_start else ", which joined mid-run"
            with self._lock:
                self._unmeasured[address] = e.message
            return f"trace: no clock offset for {address}{when} ({e.message}): its phases left out"
        with self._lock:
            self.offsets[address] = off
        return None

    # ------------------------------------------------------------------ per request
    def begin(self, i: int) -> None:
        """A worker took request ``i``."""
        with self._lock:
            self._recs.setdefault(i, _Rec()).active = True

    def sent(self, i: int, p: str, d: str) -> None:
        with self._lock:
            r = self._recs.setdefault(i, _Rec())
            r.t_wall, r.p, r.d = time.time(), p, d

    def repicked(self, i: int, p: str) -> None:
        """Request ``i`` goes to P ``p`` after all (the one picked first left or went down)."""
        with self._lock:
            self._recs.setdefault(i, _Rec()).p = p

    def legs(
        self,
        i: int,
        rep: protocol.DecodeRep,
        pool: control.ClientPool,
        submit: Callable[..., object] | None = None,
    ) -> None:
        """D answered request ``i`` (its phases); ask P how the push went (its phases): on
        ``submit``'s thread when given (the worker goes on), else on this one -- either holding
        no other client of ``pool`` (one client per thread)."""
        with self._lock:
            r = self._recs.setdefault(i, _Rec())
            r.d_phases = dict(rep.phases)
            p = r.p
            ask = bool(p) and (rep.outcome == "ok" or ph.PUSH_REG_SENT in rep.phases)
            r.asking_p = ask and submit is not None
        if not ask:
            return  # P never saw a registration of it: nothing to ask
        if submit is None:
            self._ask_p(i, r, p, rep, pool)
            return
        try:
            submit(self._ask_p, i, r, p, rep, pool)
        except RuntimeError:  # the executor is closed: the run is over
            self._asked(i, r, {}, "P not asked: drive is stopping")

    def _ask_p(
        self, i: int, r: _Rec, p: str, rep: protocol.DecodeRep, pool: control.ClientPool
    ) -> None:
        wait = P_WAIT_OK_S if rep.outcome == "ok" else P_WAIT_FAILED_S
        note = ""
        got: dict[str, float] = {}
        try:
            with pool.borrow(p) as c:
                pr = control.call(
                    c,
                    protocol.PushWaitReq(transfer_id=rep.transfer_id, timeout_s=wait),
                    timeout_s=wait + 2.0,
                )
            if isinstance(pr, protocol.PushWaitRep):
                got = dict(pr.phases)
                if pr.outcome != "ok":
                    note = f"P: {pr.outcome}" + (f" ({pr.reason})" if pr.reason else "")
        except KvpushError as e:
            note = f"P not asked: {e.message}"
        self._asked(i, r, got, note)

    def _asked(self, i: int, r: _Rec, got: dict[str, float], note: str) -> None:
        with self._lock:
            r.p_phases, r.p_note = got, note
            r.asking_p = False
            self._ended.notify_all()
            if not r.complete or self._recs.get(i) is not r:
                return
            self._recs.pop(i)
        self._write(i, r)

    def resolved(self, result: RequestResult) -> None:
        """The request's result is decided (any thread)."""
        with self._lock:
            r = self._recs.setdefault(result.index, _Rec())
            r.result = result
            if not r.complete:
                return
            self._recs.pop(result.index)
        self._write(result.index, r)

    def end(self, i: int) -> None:
        """The worker is done with request ``i``."""
        with self._lock:
            r = self._recs.get(i)
            if r is None:
                return
            r.active = False
            self._ended.notify_all()
            if not r.complete:
                return
            self._recs.pop(i)
        self._write(i, r)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Give workers still busy with a decided request up to ``wait_s`` to bring its phases,
        write what is left with what is known, close the file."""
        until = time.monotonic() + wait_s
        with self._lock:
            while any(r.result is not None and not r.complete for r in self._recs.values()):
                left_s = until - time.monotonic()
                if left_s <= 0:
                    break
                self._ended.wait(left_s)
            left = sorted((i, r) for i, r in self._recs.items() if r.result is not None)
            self._recs.clear()
        for i, r in left:
            self._write(i, r)
        self._f.close()

    # ------------------------------------------------------------------ the record
    def record(self, i: int, r: _Rec) -> TraceRecord:
        res = r.result
        assert res is not None
        stamps: dict[str, float] = {}
        err = 0.0
        missing = []
        for role, peer, got in (("D", r.d, r.d_phases), ("P", r.p, r.p_phases)):
            off = self.offsets.get(peer)
            if not got or not r.t_wall:
                continue
            if off is None:
                why = self._unmeasured.get(peer, "not measured")
                missing.append(f"{role} {peer}: no clock offset ({why})")
                continue
            err += off.error_s
            for name, t in got.items():
                stamps[name] = round(t - off.offset_s - r.t_wall, 6)
        out: TraceRecord = {
            "transfer_id": res.transfer_id,
            "index": i,
            "outcome": "ok" if res.ok else "failed",
            "reason": res.reason,
            "detail": res.detail,
            "prefill": res.prefill or r.p,
            "decode": res.decode or r.d,
            "latency_s": round(res.latency_s, 6),
            "phases": ph.ordered(stamps),
            "clock_error_s": round(err, 6),
        }
        if not res.ok:
            out["ended_at"] = ph.last_reached(stamps)
        if r.p_note:
            out["p_note"] = r.p_note
        if missing:
            out["phases_missing"] = "; ".join(missing)
        return out

    def _write(self, i: int, r: _Rec) -> None:
        rec = self.record(i, r)
        line = json.dumps(rec, separators=(",", ":"))
        with self._lock:
            self.records.append(rec)
            try:
                self._f.write(line + "\n")
            except (OSError, ValueError) as e:  # disk full, or closed after the run
                log.warning("trace line of %s not written: %s", rec["transfer_id"], e)


def phase_stats(records: Iterable[Mapping[str, object]]) -> dict[str, dict[str, float]]:
    """Per phase, over the ok records that reached it: count, p50, p99 and max of the seconds
    since the request was sent (nearest rank, as drive's latency)."""
    by: dict[str, list[float]] = {}
    for rec in records:
        if rec.get("outcome") != "ok":
            continue
        phases = rec.get("phases", {})
        assert isinstance(phases, dict), "a trace record's phases are a map"
        for name, t in phases.items():
            by.setdefault(name, []).append(float(t))
    out: dict[str, dict[str, float]] = {}
    known = [p.value for p in ph.ORDER if p.value in by]
    for name in known + [k for k in by if k not in known]:
        vs = by[name]
        out[name] = {
            "count": len(vs),
            "p50": percentile(vs, 50),
            "p99": percentile(vs, 99),
            "max": max(vs),
        }
    return out
