"""The router role: send both legs of N requests to running P and D endpoints, account for each.

Owns ``Driver`` (behind ``kvpush drive`` and ``kvpush demo``). Guarantees:

* **every request is accounted for**: the report has exactly ``requests`` results; a request
  ends as ok, or failed with one ``Failure`` reason and detail -- an exception in a worker
  becomes ``internal_error``, a request never sent after Ctrl-C becomes ``cancelled``. Each
  result is recorded once: the first of (decode reply, prefill failure, peer found dead,
  interrupt) decides it, later news of the same request is dropped.
* **planned resources**: worker threads borrow side-channel connections from two bounded
  ``ClientPool`` s (decode legs; prefill legs), so the socket count is fixed up front (ZMQ holds
  at most 1023 sockets per process; ``plan_sockets``): a socket per worker, prefill-leg sockets
  never more than the requests in flight need, and a fixed reserve (the monitor's clients of
  busy peers, the registry's checks, replacement workers) -- the number of peers costs nothing,
  only peers with work in flight hold a socket. ``--concurrency`` above what fits runs that
  many requests at a time and says so in the report's notes.
* **fail fast, route around**: ``kvpush.commands.drive.health`` marks a peer that refuses
  connections or misses a liveness check down at once; new requests go round robin to the peers
  still up, a request that finds no peer of a role up waits ``peer_grace_s`` for one to come back
  (so does one whose P left the rotation or went down between its pick and its prefill leg: it picks
  another P first)
  (``kvpush.commands.drive.readmit.PeerGrace``: a restart is a dip, not the end of the run), then
  fails with ``decode_unreachable`` / ``prefill_unreachable``; a down peer is re-checked -- drive's
  preflight again, for that peer -- and comes back. A D that answers as a new incarnation (it
  restarted under drive) is marked down at once: what was in flight there fails with
  ``peer_restarted``.

Threads: ``run`` runs on the caller's thread and only waits, watches and times out; ``W``
worker threads each send one request's decode leg at a time (it blocks until D has the KV),
while its prefill leg goes to a small executor per P (prefill legs are short); the monitor
thread of ``Health``. ``on_result``/``on_event`` are called from those threads. Nothing here
imports typer or rich.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.address import format_address, parse_address
from kvpush.commands.common import control, reasons
from kvpush.commands.common.results import DriveConfig, DriveReport, RequestResult, summarize
from kvpush.commands.drive.health import MONITOR_CLIENTS, Health, Peer
from kvpush.commands.drive.notes import down_at_start_note, long_run_note
from kvpush.commands.drive.preflight import CHECK_THREADS, check_peers
from kvpush.commands.drive.readmit import Checked, PeerGrace, Readmission
from kvpush.commands.drive.senders import Senders
from kvpush.commands.drive.trace import Tracer, phase_stats
from kvpush.config import Role
from kvpush.errors import KvpushError, PeerUnreachableError
from kvpush.logsafe import shown
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol

log = logging.getLogger(__name__)

#: Side-channel sockets one drive may open (ZMQ's default limit is 1023 per process).
SOCKET_BUDGET = 1000
#: Threads (and sockets) per prefill endpoint for prefill legs.
PREFILL_THREADS = 16
#: A decode leg's client waits this much longer than D's own deadline for D's answer.
DECODE_MARGIN_S = 5.0
#: Each request first contacts its D (get_meta_msg) within this: a worker that picked a peer
#: that just died loses seconds, not a whole request timeout, and the request goes elsewhere.
CONTACT_S = 5.0
#: Workers replaced after their peer died under them (each keeps its socket until its deadline).
REPLACEMENT_RESERVE = 20
#: Sockets kept spare beyond every planned one.
SPARE_SOCKETS = 8

__all__ = [
    "DriveConfig",
    "DriveHooks",
    "DriveReport",
    "Driver",
    "RequestResult",
    "drive",
    "plan_sockets",
    "summarize",
]


def plan_sockets(want: int, n_prefill: int, p_threads: int) -> tuple[int, int]:
    """(workers, prefill-leg sockets) within ``SOCKET_BUDGET``. Each worker holds one D socket;
    prefill legs hold one each, and there are never more of them than requests in flight (one
    per worker), plus one executor's worth for the trace's questions to P -- nor more than the
    Ps' executor threads. The rest is a fixed reserve: the monitor's clients of busy peers,
    the registry's checks, replacement workers. How many peers there are costs nothing."""
    room = SOCKET_BUDGET - SPARE_SOCKETS - REPLACEMENT_RESERVE - MONITOR_CLIENTS - CHECK_THREADS
    threads = p_threads * max(1, n_prefill)
    # w + min(threads, w + p_threads) <= room: either term of the min may be the one that fits.
    workers = max(1, min(want, max(room - threads, (room - p_threads) // 2)))
    return workers, min(threads, workers + p_threads)


@dataclass(frozen=True)
class DriveHooks:
    """What the caller of a ``Driver`` is told while it runs (None: nothing): ``on_result`` of
    each request and ``on_event`` of each peer event (on the workers' and the monitor's threads),
    ``before_request`` with a request's index before it is sent (on a worker), ``on_tick``
    every ``tick_s`` (on the thread of ``run``)."""

    on_result: Callable[[RequestResult], None] | None = None
    before_request: Callable[[int], None] | None = None
    on_event: Callable[[str], None] | None = None
    on_tick: Callable[[], None] | None = None
    tick_s: float = 3.0


class Driver:
    """Runs one batch of requests; ``add_decode`` may grow the D rotation while it runs."""

    def __init__(
        self,
        cfg: DriveConfig,
        hooks: DriveHooks | None = None,
        tracer: Tracer | None = None,
        checked: Checked | None = None,
    ) -> None:
        self.cfg = cfg
        self.hooks = hooks or DriveHooks()
        self._tracer = tracer  # drive --trace (kvpush.commands.drive.trace)
        self._lock = threading.Lock()
        self._results: list[RequestResult | None] = [None] * cfg.requests
        self._t_sent: dict[int, tuple[float, str, str]] = {}  # index -> (t0, P, D)
        self._done_count = 0
        self._ok_count = 0
        self._all_done = threading.Event()
        self._next = 0
        self._cancel = threading.Event()
        self._force = threading.Event()
        self._t0 = 0.0
        self.events: list[str] = []
        self.notes: list[str] = []
        self._wids = itertools.count()
        self._worker_of: dict[int, int] = {}  # request index -> the worker sending it
        self._retired: set[int] = set()
        self._replacements = 0
        p_threads = self._p_threads = min(PREFILL_THREADS, cfg.concurrency, cfg.requests)
        want = min(cfg.concurrency, cfg.requests)
        self.workers, self._p_budget = plan_sockets(want, len(cfg.prefill), p_threads)
        planned = long_run_note(cfg)
        if planned:
            self.notes.append(planned)
        if self.workers < min(cfg.concurrency, cfg.requests):
            self.notes.append(
                f"--concurrency {cfg.concurrency} is more side-channel connections than one "
                f"process may hold: at most {self.workers} requests were in flight at a time"
            )
        self._d_pool = control.ClientPool(cfg.auth_token, cfg.timeout_s, self.workers)
        self._p_pool = control.ClientPool(cfg.auth_token, cfg.timeout_s, self._p_budget)
        self._p_exec = {p: Senders(p_threads, f"drive-p{i}") for i, p in enumerate(cfg.prefill)}
        # From the preflight: run()'s own, or the one drive --registry did (``checked``).
        self._readmission: Readmission | None = None
        if checked is not None:
            self._readmission = Readmission(cfg, checked.meta, checked.reference)
        self.health = Health(
            cfg,
            on_down=self._on_down,
            on_event=self._event,
            readmit=self._readmit,
        )
        self.grace = PeerGrace(cfg.peer_grace_s, self.health.any_up)
        for p in cfg.prefill:
            self.health.add(p, Role.PREFILL)
        for d in cfg.decode:
            self.health.add(d, Role.DECODE)

    # ------------------------------------------------------------------ control (any thread)
    def add_decode(self, address: str) -> None:
        d = format_address(*parse_address(address))
        self.trace_join(d)
        self.health.add(d, Role.DECODE)

    def add_prefill(self, address: str) -> None:
        """A P that joined while the run goes on (``drive --registry``): its own prefill-leg
        executor and connections (within the plan: ``plan_sockets``), then into the
        rotation."""
        p = format_address(*parse_address(address))
        self.trace_join(p)
        with self._lock:
            if p not in self._p_exec:
                self._p_exec[p] = Senders(self._p_threads, f"drive-p{len(self._p_exec)}")
                more = min(self._p_threads, self.workers + self._p_threads - self._p_budget)
                if more > 0:
                    self._p_budget += more
                    self._p_pool.grow(more)
        self.health.add(p, Role.PREFILL)

    def admit(self, address: str, role: reasons.Leg) -> None:
        """A peer checked outside the driver (``drive --registry``'s checker: it passed
        ``readmission.fit``) goes into the rotation."""
        if role == Role.DECODE:
            self.add_decode(address)
        else:
            self.add_prefill(address)

    @property
    def readmission(self) -> Readmission | None:
        """What a peer must match to get requests (None: the preflight was off)."""
        return self._readmission

    def trace_join(self, address: str) -> None:
        """A peer that joins mid-run gets its clock offset measured (``drive --trace``), or a
        note says why its phases are left out of the trace. On the caller's thread."""
        if self._tracer is None:
            return
        note = self._tracer.joined(address)
        if note:
            with self._lock:
                self.notes.append(shown(note))

    def remove_peer(self, address: str) -> bool:
        """No new request goes to ``address`` (its registry key went); those in flight there
        finish or fail as they would."""
        return self.health.remove(format_address(*parse_address(address)))

    def cancel(self) -> None:
        """Stop intake; in-flight requests get ``grace_s`` to finish (a second call: none)."""
        if self._cancel.is_set():
            self._force.set()
        self._cancel.set()

    @property
    def decodes(self) -> list[str]:
        return [a for a, role, *_ in self.health.rows() if role == Role.DECODE]

    def progress(self) -> tuple[int, int, int]:
        """(done, ok, failed) so far."""
        with self._lock:
            return self._done_count, self._ok_count, self._done_count - self._ok_count

    def in_flight(self) -> int:
        with self._lock:
            return len(self._t_sent)

    def _event(self, text: str) -> None:
        text = shown(text)  # peer-given words (a reason, an address) must not forge lines
        line = f"{time.monotonic() - self._t0:.2f}s {text}"
        with self._lock:
            self.events.append(line)
        log.info("%s", text)
        if self.hooks.on_event is not None:
            self.hooks.on_event(text)

    # ------------------------------------------------------------------ run
    def run(self) -> DriveReport:
        down: dict[str, str] = {}
        if self.cfg.preflight:
            meta, down = check_peers(self.cfg)
            self._readmission = Readmission(self.cfg, meta)
        if self._tracer is not None:
            self.notes.extend(self._tracer.start([*self.cfg.prefill, *self.cfg.decode]))
        self._t0 = time.monotonic()
        for addr, why in down.items():  # unreachable at start: the run goes on with the others
            self.health.down_at_start(addr, why)
            self.notes.append(shown(down_at_start_note(addr, why)))
            self._event(f"{addr} is down at start ({why}): requests avoid it until it answers")
        self.health.start()
        started = 0
        try:
            for _ in range(self.workers):
                if not self._spawn_worker():
                    break
                started += 1
            if started == 0:
                raise KvpushError("drive could not start a worker thread", "lower --concurrency")
            self._wait()
        finally:
            self.health.stop()
            if self._tracer is not None:  # before the pools close: workers may still ask P
                self._tracer.close()
            for ex in list(self._p_exec.values()):
                ex.close()
            self._d_pool.close()
            self._p_pool.close()
        elapsed = time.monotonic() - self._t0
        with self._lock:
            results = [r for r in self._results if r is not None]
            events = list(self.events)
        assert len(results) == self.cfg.requests
        report = summarize(
            results,
            elapsed,
            interrupted=self._cancel.is_set(),
            concurrency=min(self.workers, started),
            notes=self.notes,
            peer_events=events,
        )
        if self._tracer is not None:
            report = dataclasses.replace(report, phases=phase_stats(self._tracer.records))
        return report

    def _wait(self) -> None:
        grace_until: float | None = None
        next_tick = time.monotonic() + self.hooks.tick_s
        while not self._all_done.wait(0.05):
            if self.hooks.on_tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.hooks.tick_s
                self.hooks.on_tick()
            if self._cancel.is_set():
                if grace_until is None:
                    grace_until = time.monotonic() + self.cfg.grace_s
                    self._fail_untaken(Failure.CANCELLED, "not sent: interrupted")
                if self._force.is_set() or time.monotonic() >= grace_until:
                    self._fail_unresolved(Failure.CANCELLED, "in flight when interrupted")
                continue
            self._past_grace()

    def _past_grace(self) -> None:
        """No peer of a role up for longer than the grace: what is left fails now."""
        for role in (Role.PREFILL, Role.DECODE):
            if self.grace.expired(role):  # type: ignore[arg-type]
                self._fail_untaken(
                    reasons.UNREACHABLE[role],
                    self.health.down_reason(role),  # type: ignore[arg-type]
                )

    def _readmit(self, address: str, role: reasons.Leg) -> str:
        """Monitor thread: a peer that was down passes the preflight again (else why not)."""
        return self._readmission.check(address, role) if self._readmission is not None else ""

    def _held(self, role: reasons.Leg, i: int) -> bool:
        """No peer of ``role`` is up: hold request ``i`` for the grace; True when one is back."""
        with self._lock:
            if self._results[i] is not None:
                return False
        return self.grace.wait(role, lambda: self._cancel.is_set() or self._results[i] is not None)

    # ------------------------------------------------------------------ recording
    def _resolve(self, i: int, result: RequestResult) -> bool:
        """Record request ``i``'s result unless it already has one; True when recorded."""
        with self._lock:
            if self._results[i] is not None:
                return False
            self._results[i] = result
            self._t_sent.pop(i, None)
            self._worker_of.pop(i, None)
            self._done_count += 1
            self._ok_count += result.ok
            if self._done_count == self.cfg.requests:
                self._all_done.set()
        if self._tracer is not None:
            self._tracer.resolved(result)
        if self.hooks.on_result is not None:
            try:
                self.hooks.on_result(result)
            except Exception:
                log.exception("on_result callback failed")
        return True

    def _fail(self, i: int, reason: Failure, detail: str, p: str = "", d: str = "") -> None:
        with self._lock:
            t0, p0, d0 = self._t_sent.get(i, (0.0, p, d))
        latency = time.monotonic() - t0 if t0 else 0.0
        self._resolve(
            i,
            RequestResult(
                i, self._tid(i), p0, d0, False, reason.value, detail[:500], latency, 0, None
            ),
        )

    def _fail_untaken(self, reason: Failure, detail: str) -> None:
        with self._lock:
            first, self._next = self._next, self.cfg.requests
        for i in range(first, self.cfg.requests):
            self._fail(i, reason, detail)

    def _fail_unresolved(self, reason: Failure, detail: str) -> None:
        with self._lock:
            pending = [i for i, r in enumerate(self._results) if r is None]
        for i in pending:
            self._fail(i, reason, detail)

    def _tid(self, i: int) -> str:
        return f"{self.cfg.run_id}-{i}"

    # ------------------------------------------------------------------ workers
    def _take(self) -> int | None:
        with self._lock:
            if self._cancel.is_set() or self._next >= self.cfg.requests:
                return None
            i = self._next
            self._next += 1
        if self.hooks.before_request is not None:
            self.hooks.before_request(i)
        if self.cfg.rate:
            wait = self._t0 + i / self.cfg.rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        return i

    def _spawn_worker(self) -> bool:
        wid = next(self._wids)
        t = threading.Thread(target=self._worker, args=(wid,), name=f"drive-{wid}", daemon=True)
        try:
            t.start()
        except RuntimeError as e:  # can't start new thread: run with those there are
            self.notes.append(f"a worker thread could not start: {e}")
            return False
        return True

    def _worker(self, wid: int) -> None:
        while wid not in self._retired:
            i = self._take()
            if i is None:
                return
            if self._tracer is not None:
                self._tracer.begin(i)
            try:
                self._one(i, wid)
            except BaseException as e:  # never a vanished request: it fails with a reason
                log.exception("drive worker failed on request %d", i)
                self._fail(i, Failure.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
            finally:
                if self._tracer is not None:
                    self._tracer.end(i)

    def _one(self, i: int, wid: int) -> None:
        tried: set[str] = set()
        # With a worker per D at least, each worker has a home D (worker w: D number w mod
        # the Ds): a D that freezes holds only its own workers, in their requests already
        # sent there, while the others keep every healthy D busy. Fewer workers than Ds go
        # round robin.
        home = wid if self.workers >= self.health.count(Role.DECODE) else None
        while True:
            p = self.health.pick(Role.PREFILL)
            d = self.health.pick(Role.DECODE, home, tried)
            if p is None or d is None:
                if p is not None and tried and self.health.any_up(Role.DECODE):
                    # every D that is up could not be reached just now
                    last = sorted(tried)[-1]
                    self._fail(i, reasons.UNREACHABLE[Role.DECODE], f"D {last}: no contact")
                    return
                tried.clear()  # the Ds tried went down meanwhile: wait for one (the grace)
                role: reasons.Leg = Role.PREFILL if p is None else Role.DECODE
                if self._held(role, i):
                    continue  # one is back up within the grace
                self._fail(i, reasons.UNREACHABLE[role], self.health.down_reason(role))
                return
            tried.add(d)
            with self._lock:
                if self._results[i] is not None:  # failed meanwhile (no peer up, interrupted)
                    return
                self._t_sent[i] = (time.monotonic(), p, d)
                self._worker_of[i] = wid
            if self._tracer is not None:
                self._tracer.sent(i, p, d)
            if not self.health.sent(d, i):
                continue  # went down this instant: pick again
            try:
                if self._decode_leg(i, p, d):
                    return
            finally:
                self.health.finished(d, i)

    def _prefill_for(self, i: int, p: str, d: str) -> str | None:
        """The P request ``i`` goes to, counted in flight there: ``p``, or -- when ``p`` left
        the rotation (its registry key went) or went down since it was picked; nothing was
        sent to it -- another P that is up, waiting up to the grace for one. None when the
        request failed (no P up within the grace) or was decided meanwhile."""
        while not self.health.sent(p, i):
            other = self.health.pick(Role.PREFILL)
            if other is None:
                if self._held(Role.PREFILL, i):
                    continue
                reason = reasons.UNREACHABLE[Role.PREFILL]
                self._fail(i, reason, self.health.down_reason(Role.PREFILL))
                return None
            p = other
            with self._lock:
                if self._results[i] is not None:
                    return None
                t0 = self._t_sent.get(i, (time.monotonic(), p, d))[0]
                self._t_sent[i] = (t0, p, d)
            if self._tracer is not None:
                self._tracer.repicked(i, p)
        return p

    def _on_down(self, peer: Peer, dead: bool, inflight: list[int]) -> None:
        """Monitor thread: a dead peer's requests in flight fail now; their workers are blocked
        until their own deadline, so each is retired and replaced (within the socket reserve)."""
        reason = Failure.PEER_RESTARTED if peer.restarted else reasons.UNREACHABLE[peer.role]
        for i in inflight:
            with self._lock:
                wid = self._worker_of.get(i)
                replace = (
                    wid is not None
                    and wid not in self._retired
                    and peer.role == Role.DECODE
                    and self._replacements < REPLACEMENT_RESERVE
                )
                if replace:
                    assert wid is not None
                    self._retired.add(wid)
                    self._replacements += 1
            self._fail(i, reason, f"{peer.address} ({peer.role}): {peer.why}")
            if replace:
                self._d_pool.grow(1)  # the retired worker keeps its socket until its deadline
                self._spawn_worker()

    def _same_incarnation(self, d: str, kv: object) -> bool:
        """D answered as the incarnation that passed the checks; else (it restarted, or is
        still starting) it is marked down and re-checked."""
        inc = getattr(kv, "incarnation", "")
        starting = getattr(kv, "error", "") == "starting"
        if self._readmission is None or (not starting and self._readmission.observe(d, inc)):
            return True
        self.health.restarted(d)
        return False

    def _prefill_leg(self, i: int, p: str) -> None:
        """On P's executor: send the prefill leg; a failure decides the request at once."""
        try:
            try:
                with self._p_pool.borrow(p) as c:
                    rep = control.call(
                        c, protocol.PrefillReq(transfer_id=self._tid(i), num_blocks=self.cfg.blocks)
                    )
                self.health.replied(p)
            except KvpushError as e:
                reason, detail = reasons.from_error(e, Role.PREFILL)
                if isinstance(e, PeerUnreachableError):  # refused or timed out: check it
                    self.health.suspect(p)
                if reason is Failure.DEADLINE:
                    detail += f" (--timeout {self.cfg.timeout_s:g})"
                self._fail(i, reason, f"P {p}: {detail}")
                return
            if not isinstance(rep, protocol.PrefillRep):
                self._fail(i, Failure.MALFORMED_FRAME, f"P {p} answered with {type(rep).__name__}")
            elif rep.outcome != "ok":
                reason, detail = reasons.from_peer(rep.reason)
                self._fail(i, reason, f"P {p}: {detail or rep.reason}")
        except BaseException as e:
            log.exception("prefill leg of request %d failed", i)
            self._fail(i, Failure.INTERNAL_ERROR, f"P {p}: {type(e).__name__}: {e}")
        finally:
            self.health.finished(p, i)

    def _decode_leg(self, i: int, p: str, d: str) -> bool:
        """Contact D (bounded by ``CONTACT_S``), send the prefill leg, send the decode leg and
        wait for D's answer. False when D could not be contacted (nothing was sent: the
        request may go to another D)."""
        try:
            with self._d_pool.borrow(d) as c:
                try:
                    ident = c.identify(timeout_s=CONTACT_S)
                except KvpushError:
                    self.health.suspect(d)
                    return False
                if not self._same_incarnation(d, ident.payload.kvpush):
                    return False  # nothing sent: it is re-checked before it gets traffic
                got = self._prefill_for(i, p, d)
                if got is None:
                    return True  # no P up within the grace: failed
                p = got
                ph, pp = parse_address(p)
                try:
                    pfut = self._p_exec[p].submit(self._prefill_leg, i, p)
                except BaseException:
                    self.health.finished(p, i)
                    raise
                try:
                    rep = control.call(
                        c,
                        protocol.DecodeReq(
                            transfer_id=self._tid(i),
                            prefill_host=ph,
                            prefill_port=pp,
                            num_blocks=self.cfg.blocks,
                            deadline_s=self.cfg.timeout_s,
                        ),
                        timeout_s=self.cfg.timeout_s + DECODE_MARGIN_S,
                    )
                finally:
                    pfut.result()  # short: P answers once its blocks are filled
        except KvpushError as e:
            reason, detail = reasons.from_error(e, Role.DECODE)
            if isinstance(e, PeerUnreachableError):  # refused or timed out: check it
                self.health.suspect(d)
            self._fail(i, reason, f"D {d}: {detail}")
            return True
        self.health.replied(d)
        if not isinstance(rep, protocol.DecodeRep):
            self._fail(i, Failure.MALFORMED_FRAME, f"D {d} answered with {type(rep).__name__}")
            return True
        with self._lock:
            t0 = self._t_sent.get(i, (time.monotonic(), p, d))[0]
        latency = time.monotonic() - t0
        if rep.outcome == "ok":
            result = RequestResult(
                i, self._tid(i), p, d, True, "", "", latency, rep.nbytes, rep.verified
            )
        else:
            reason, detail = reasons.from_peer(rep.reason or "internal_error", rep.detail)
            result = RequestResult(
                i, self._tid(i), p, d, False, reason.value, f"D {d}: {detail}"[:500], latency, 0,
                None,
            )  # fmt: skip
        self._resolve(i, result)
        if self._tracer is not None:  # P's phases, asked on P's executor: the worker goes on
            self._tracer.legs(i, rep, self._p_pool, self._p_exec[p].submit)
        return True


def drive(
    cfg: DriveConfig, on_result: Callable[[RequestResult], None] | None = None
) -> DriveReport:
    return Driver(cfg, DriveHooks(on_result=on_result)).run()
