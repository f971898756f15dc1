"""The router role: send both legs of N requests to running P and D endpoints, account for each.

Owns ``Driver`` (behind ``kvpush drive`` and ``kvpush demo``). Guarantees:

* **every request is accounted for** (``kvpush.commands.drive.ledger``): the report has
  exactly ``requests`` results; a request ends as ok, or failed with one ``Failure`` reason and
  detail -- an exception in a worker becomes ``internal_error``, a request never sent after
  Ctrl-C becomes ``cancelled``, one its schedule refuses fails with the schedule's reason.
* **a schedule** (``kvpush.commands.drive.schedule``) says when each request is due and how
  many blocks it asks for: ``Steady`` (``--rate``, ``--blocks``) or a replayed trace
  (``drive --workload``); how one request is sent is ``kvpush.commands.drive.legs``.
* **planned resources**: worker threads borrow side-channel connections from two bounded
  ``ClientPool`` s (decode legs; prefill legs), so the socket count is fixed up front
  (``kvpush.commands.drive.plan``). ``--concurrency`` above what fits runs that many requests
  at a time and says so in the report's notes.
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
worker threads each send one request's decode leg at a time (``Legs.send``: it blocks until
D has the KV), while its prefill leg goes to a small executor per P (prefill legs are short);
the monitor thread of ``Health``. ``on_result``/``on_event`` are called from those threads.
Nothing here imports typer or rich.
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
from kvpush.commands.drive.health import Health, Peer
from kvpush.commands.drive.ledger import Ledger
from kvpush.commands.drive.legs import CONTACT_S, Legs
from kvpush.commands.drive.notes import down_at_start_note, long_run_note
from kvpush.commands.drive.otlp import DriveSpans
from kvpush.commands.drive.plan import (
    PREFILL_THREADS,
    REPLACEMENT_RESERVE,
    SOCKET_BUDGET,
    plan_sockets,
)
from kvpush.commands.drive.preflight import check_peers
from kvpush.commands.drive.readmit import Checked, PeerGrace, Readmission
from kvpush.commands.drive.schedule import Pools, Schedule, Steady
from kvpush.commands.drive.senders import Senders
from kvpush.commands.drive.trace import Tracer, phase_stats
from kvpush.config import Role
from kvpush.errors import KvpushError
from kvpush.logsafe import shown
from kvpush.telemetry.names import Failure

log = logging.getLogger(__name__)

__all__ = [
    "SOCKET_BUDGET",
    "DriveConfig",
    "DriveHooks",
    "DriveReport",
    "Driver",
    "RequestResult",
    "drive",
    "plan_sockets",
    "summarize",
]


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
        schedule: Schedule | None = None,
        spans: DriveSpans | None = None,
    ) -> None:
        self.cfg = cfg
        self.hooks = hooks or DriveHooks()
        self._tracer = tracer  # drive --trace (kvpush.commands.drive.trace)
        self._spans = spans  # drive --otlp-traces-endpoint (kvpush.commands.drive.otlp)
        self._schedule: Schedule = schedule if schedule is not None else Steady(cfg)
        self._lock = threading.Lock()
        self.ledger = Ledger(cfg.requests, cfg.run_id, self._on_resolved)
        self._cancel = threading.Event()
        self._force = threading.Event()
        self._t0 = 0.0
        self.events: list[str] = []
        self.notes: list[str] = []
        self._wids = itertools.count()
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
            replaced=self._replaced,
        )
        self.grace = PeerGrace(cfg.peer_grace_s, self.health.any_up)
        self._legs = Legs(
            cfg, self.health, self.ledger, self.grace, self._cancel, self._d_pool, self._p_pool,
            self._p_exec, lambda: self._readmission, self._schedule.blocks, tracer, self.workers,
            spans,
        )  # fmt: skip
        for p in cfg.prefill:
            self.health.add(p, Role.PREFILL)
        for d in cfg.decode:
            self.health.add(d, Role.DECODE)

    # ------------------------------------------------------------------ control (any thread)
    def add_decode(self, address: str) -> None:
        d = format_address(*parse_address(address))
        self.trace_join(d)
        self.health.add(d, Role.DECODE)
        if not self._cancel.is_set():  # a router opens its connection when it learns of a D
            threading.Thread(target=self._open, args=(d,), name="drive-open", daemon=True).start()

    def _open(self, d: str) -> None:
        """Open a client to a D that joined mid-run and identify it once, so that its first
        request does not pay the socket's handshakes (~1.3 ms here); one short-lived thread,
        within the pool's budget and ``CONTACT_S``. A failure is the request path's business."""
        try:
            with self._d_pool.borrow(d) as c:
                c.identify(timeout_s=CONTACT_S)
        except KvpushError as e:
            log.debug("opening a connection to D %s ahead of its first request: %s", d, e)

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
        return self.ledger.progress()

    def in_flight(self) -> int:
        return self.ledger.in_flight()

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
        ra = self._readmission
        self._schedule.begin(self._t0, ra.pools() if ra is not None else Pools({}, {}))
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
        results = self.ledger.results()
        with self._lock:
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
        while not self.ledger.wait_all(0.05):
            if self.hooks.on_tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.hooks.tick_s
                self.hooks.on_tick()
            if self._cancel.is_set():
                if grace_until is None:
                    grace_until = time.monotonic() + self.cfg.grace_s
                    self.ledger.fail_untaken(Failure.CANCELLED, "not sent: interrupted")
                if self._force.is_set() or time.monotonic() >= grace_until:
                    self.ledger.fail_unresolved(Failure.CANCELLED, "in flight when interrupted")
                continue
            self._past_grace()

    def _past_grace(self) -> None:
        """No peer of a role up for longer than the grace: what is left fails now."""
        for role in (Role.PREFILL, Role.DECODE):
            if self.grace.expired(role):  # type: ignore[arg-type]
                self.ledger.fail_untaken(
                    reasons.UNREACHABLE[role],
                    self.health.down_reason(role),  # type: ignore[arg-type]
                )

    def _readmit(self, address: str, role: reasons.Leg) -> str:
        """Monitor thread: a peer that was down passes the preflight again (else why not)."""
        return self._readmission.check(address, role) if self._readmission is not None else ""

    def _replaced(self, address: str, incarnation: str, starting: bool) -> bool:
        """Monitor thread: another process answers at ``address`` than passed the checks."""
        ra = self._readmission
        return ra is not None and ra.replaced(address, incarnation, starting)

    def _on_resolved(self, result: RequestResult) -> None:
        """A request's result is recorded (on the thread that decided it)."""
        if self._tracer is not None:
            self._tracer.resolved(result)
        if self._spans is not None:
            self._spans.resolved(result, self._schedule.blocks(result.index))
        if self.hooks.on_result is not None:
            try:
                self.hooks.on_result(result)
            except Exception:
                log.exception("on_result callback failed")

    # ------------------------------------------------------------------ workers
    def _take(self) -> int | None:
        """The next request, once it is due (None: no more, or interrupted)."""
        if self._cancel.is_set():
            return None
        i = self.ledger.take()
        if i is None:
            return None
        if self.hooks.before_request is not None:
            self.hooks.before_request(i)
        due = self._schedule.due(i)
        if due is not None:
            wait = self._t0 + due - time.monotonic()
            if wait > 0 and self._cancel.wait(wait):
                self.ledger.fail(i, Failure.CANCELLED, "not sent: interrupted")
                return None
            self._schedule.started(i, time.monotonic() - self._t0 - due)
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
            refused = self._schedule.refuse(i)
            if refused is not None:
                self.ledger.fail(i, *refused)
                continue
            if self._tracer is not None:
                self._tracer.begin(i)
            try:
                self._legs.send(i, wid)
            except BaseException as e:  # never a vanished request: it fails with a reason
                log.exception("drive worker failed on request %d", i)
                self.ledger.fail(i, Failure.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
            finally:
                if self._tracer is not None:
                    self._tracer.end(i)

    def _on_down(self, peer: Peer, dead: bool, inflight: list[int]) -> None:
        """Monitor thread: a dead peer's requests in flight fail now; their workers are blocked
        until their own deadline, so each is retired and replaced (within the socket reserve).
        A request in flight at a dead P holds its worker's D socket and a P socket and thread
        of that P's executor (its prefill leg, which P will never answer): both are added."""
        reason = Failure.PEER_RESTARTED if peer.restarted else reasons.UNREACHABLE[peer.role]
        for i in inflight:
            wid = self.ledger.worker_of(i)
            with self._lock:
                replace = (
                    wid is not None
                    and wid not in self._retired
                    and self._replacements < REPLACEMENT_RESERVE
                )
                if replace:
                    assert wid is not None
                    self._retired.add(wid)
                    self._replacements += 1
                p_exec = self._p_exec.get(peer.address) if peer.role == Role.PREFILL else None
            self.ledger.fail(i, reason, f"{peer.address} ({peer.role}): {peer.why}")
            if replace:
                self._d_pool.grow(1)  # the retired worker keeps its socket until its deadline
                if p_exec is not None:
                    self._p_pool.grow(1)
                    p_exec.grow(1)
                self._spawn_worker()


def drive(
    cfg: DriveConfig, on_result: Callable[[RequestResult], None] | None = None
) -> DriveReport:
    return Driver(cfg, DriveHooks(on_result=on_result)).run()
