"""One request of a drive, both legs: pick a P and a D, contact D, send the prefill leg to P's
executor and the decode leg to D, and record how it ended.

Owns ``Legs`` (``send``, on a drive worker): the request goes to a D that is up -- the
worker's home D when there are enough workers (a D that freezes holds only its own workers) --
and to the next P; a D that cannot be contacted within ``CONTACT_S`` is suspected and another
is tried (nothing was sent to it); a D that answers as a new incarnation is marked restarted; a
D whose first-contact answer says it is shutting down is marked down and another D is tried. A
peer whose intake refuses a leg because it is shutting down is marked down too (the request
fails ``shutting_down``; what it took before ends with its drain's answers). While no peer of a
role is up the request waits for the grace (``PeerGrace``), then fails with the role's
``*_unreachable``. Every outcome goes to the ``Ledger`` (first news wins). With traces on
(``kvpush.commands.drive.otlp``) both legs carry the request's W3C trace context.

Threads: ``send`` on drive's workers; ``_prefill_leg`` on a P's executor (``Senders``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.address import parse_address
from kvpush.commands.common import control, reasons
from kvpush.commands.common.results import DriveConfig, RequestResult
from kvpush.commands.drive.health import Health
from kvpush.commands.drive.ledger import Ledger
from kvpush.commands.drive.otlp import DriveSpans
from kvpush.commands.drive.readmit import PeerGrace, Readmission
from kvpush.commands.drive.senders import Senders
from kvpush.commands.drive.trace import Tracer
from kvpush.config import Role
from kvpush.errors import KvpushError, PeerError, PeerUnreachableError
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol

if TYPE_CHECKING:
    from kvpush.transport.client import SideChannelClient

log = logging.getLogger(__name__)

#: A decode leg's client waits this much longer than D's own deadline for D's answer.
DECODE_MARGIN_S = 5.0
#: Each request first contacts its D (get_meta_msg) within this: a worker that picked a peer
#: that just died loses seconds, not a whole request timeout, and the request goes elsewhere.
CONTACT_S = 5.0


@dataclass
class Legs:
    """What sending a request needs: the run's config, peers, accounting and connections."""

    cfg: DriveConfig
    health: Health
    ledger: Ledger
    grace: PeerGrace
    cancelled: threading.Event
    d_pool: control.ClientPool
    p_pool: control.ClientPool
    p_exec: dict[str, Senders]  # one executor per P (drive adds one for a P that joins)
    readmission: Callable[[], Readmission | None]
    blocks: Callable[[int], int]  # request index -> its blocks (the schedule's)
    tracer: Tracer | None = None
    workers: int = 1
    spans: DriveSpans | None = None  # --otlp-traces-endpoint: each request's client span

    def send(self, i: int, wid: int) -> None:
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
                    self.ledger.fail(i, reasons.UNREACHABLE[Role.DECODE], f"D {last}: no contact")
                    return
                tried.clear()  # the Ds tried went down meanwhile: wait for one (the grace)
                role: reasons.Leg = Role.PREFILL if p is None else Role.DECODE
                if self.held(role, i):
                    continue  # one is back up within the grace
                self.ledger.fail(i, reasons.UNREACHABLE[role], self.health.down_reason(role))
                return
            tried.add(d)
            if not self.ledger.mark_sent(i, p, d, wid):
                return  # failed meanwhile (no peer up, interrupted)
            if self.tracer is not None:
                self.tracer.sent(i, p, d)
            if self.spans is not None:
                self.spans.sent(i)
            try:
                if self._decode_leg(i, p, d):
                    return
            finally:
                self.health.finished(d, i)

    def held(self, role: reasons.Leg, i: int) -> bool:
        """No peer of ``role`` is up: hold request ``i`` for the grace; True when one is back."""
        if self.ledger.decided(i):
            return False
        return self.grace.wait(role, lambda: self.cancelled.is_set() or self.ledger.decided(i))

    def _prefill_for(self, i: int, p: str, d: str) -> str | None:
        """The P request ``i`` goes to, counted in flight there: ``p``, or -- when ``p`` left
        the rotation (its registry key went) or went down since it was picked; nothing was
        sent to it -- another P that is up, waiting up to the grace for one. None when the
        request failed (no P up within the grace) or was decided meanwhile."""
        while not self.health.sent(p, i):
            other = self.health.pick(Role.PREFILL)
            if other is None:
                if self.held(Role.PREFILL, i):
                    continue
                reason = reasons.UNREACHABLE[Role.PREFILL]
                self.ledger.fail(i, reason, self.health.down_reason(Role.PREFILL))
                return None
            p = other
            if not self.ledger.repick(i, p, d):
                return None
            if self.tracer is not None:
                self.tracer.repicked(i, p)
        return p

    def _same_incarnation(self, d: str, kv: object) -> bool:
        """D answered as the incarnation that passed the checks; else (it restarted, or is
        still starting) it is marked down and re-checked."""
        inc = getattr(kv, "incarnation", "")
        starting = getattr(kv, "error", "") == "starting"
        ra = self.readmission()
        if ra is None or (not starting and ra.observe(d, inc)):
            return True
        self.health.restarted(d)
        return False

    def _heard(self, address: str, e: KvpushError, reason: Failure) -> None:
        """What a leg's error says of its peer: refused or timed out (checked now), a new
        incarnation (down now), or its own side channel refusing because it is shutting down
        (down now, not dead)."""
        if isinstance(e, PeerUnreachableError):
            self.health.suspect(address)
        elif reason is Failure.PEER_RESTARTED:
            self.health.restarted(address)
        elif reason is Failure.SHUTTING_DOWN and isinstance(e, PeerError):
            self.health.stopping(address)

    def _prefill_leg(self, i: int, p: str) -> None:
        """On P's executor: send the prefill leg; a failure decides the request at once."""
        try:
            try:
                tp, ts = self.spans.context(i) if self.spans is not None else ("", "")
                req = protocol.PrefillReq(
                    transfer_id=self.ledger.tid(i),
                    num_blocks=self.blocks(i),
                    traceparent=tp,
                    tracestate=ts,
                )
                with self.p_pool.borrow(p) as c:
                    rep = control.call(c, req)
                self.health.replied(p)
            except KvpushError as e:
                reason, detail = reasons.from_served_error(e, Role.PREFILL)
                self._heard(p, e, reason)
                if reason is Failure.DEADLINE:
                    detail += f" (--timeout {self.cfg.timeout_s:g})"
                self.ledger.fail(i, reason, f"P {p}: {detail}")
                return
            if not isinstance(rep, protocol.PrefillRep):
                name = type(rep).__name__
                self.ledger.fail(i, Failure.MALFORMED_FRAME, f"P {p} answered with {name}")
            elif rep.outcome != "ok":
                reason, detail = reasons.from_peer(rep.reason)
                if reason is Failure.SHUTTING_DOWN:  # P's intake refused it: P is stopping
                    self.health.stopping(p)
                self.ledger.fail(i, reason, f"P {p}: {detail or rep.reason}")
        except BaseException as e:
            log.exception("prefill leg of request %d failed", i)
            self.ledger.fail(i, Failure.INTERNAL_ERROR, f"P {p}: {type(e).__name__}: {e}")
        finally:
            self.health.finished(p, i)

    def _decode_leg(self, i: int, p: str, d: str) -> bool:
        """Contact D (bounded by ``CONTACT_S``), send the prefill leg, send the decode leg and
        wait for D's answer. False when D could not be contacted (nothing was sent: the
        request may go to another D). The request counts in flight at D -- what D's health
        fails if D dies -- only once D answered the contact: one still contacting a D that
        froze goes to another D when its contact times out."""
        try:
            with self.d_pool.borrow(d) as c:
                try:
                    ident = c.identify(timeout_s=CONTACT_S)
                except KvpushError:
                    self.health.suspect(d)
                    return False
                kv = ident.payload.kvpush
                if kv is not None and kv.stopping:
                    self.health.stopping(d)
                    return False  # nothing sent: another D takes the request
                if not self._same_incarnation(d, kv):
                    return False  # nothing sent: it is re-checked before it gets traffic
                if not self.health.sent(d, i):
                    return False  # went down this instant: nothing sent, pick again
                got = self._prefill_for(i, p, d)
                if got is None:
                    return True  # no P up within the grace: failed
                p = got
                rep = self._both_legs(c, i, p)
        except KvpushError as e:
            reason, detail = reasons.from_served_error(e, Role.DECODE)
            self._heard(d, e, reason)
            self.ledger.fail(i, reason, f"D {d}: {detail}")
            return True
        self.health.replied(d)
        self._answered(i, p, d, rep)
        return True

    def _both_legs(self, c: SideChannelClient, i: int, p: str) -> protocol.SideReply:
        """The prefill leg on P's executor and the decode leg on ``c``, in flight together;
        D's answer (once P's leg is done too)."""
        ph, pp = parse_address(p)
        try:
            pfut = self.p_exec[p].submit(self._prefill_leg, i, p)
        except BaseException:
            self.health.finished(p, i)
            raise
        tp, ts = self.spans.context(i) if self.spans is not None else ("", "")
        try:
            return control.call(
                c,
                protocol.DecodeReq(
                    transfer_id=self.ledger.tid(i),
                    prefill_host=ph,
                    prefill_port=pp,
                    num_blocks=self.blocks(i),
                    deadline_s=self.cfg.timeout_s,
                    traceparent=tp,
                    tracestate=ts,
                ),
                timeout_s=self.cfg.timeout_s + DECODE_MARGIN_S,
            )
        finally:
            pfut.result()  # short: P answers once its blocks are filled

    def _answered(self, i: int, p: str, d: str, rep: protocol.SideReply) -> None:
        """D's answer to request ``i`` decides it (unless something else did first)."""
        if not isinstance(rep, protocol.DecodeRep):
            name = type(rep).__name__
            self.ledger.fail(i, Failure.MALFORMED_FRAME, f"D {d} answered with {name}")
            return
        latency = time.monotonic() - (self.ledger.sent_at(i) or time.monotonic())
        tid = self.ledger.tid(i)
        if rep.outcome == "ok":
            result = RequestResult(i, tid, p, d, True, "", "", latency, rep.nbytes, rep.verified)
        else:
            reason, detail = reasons.from_peer(rep.reason or "internal_error", rep.detail)
            result = RequestResult(
                i, tid, p, d, False, reason.value, f"D {d}: {detail}"[:500], latency, 0, None
            )
        self.ledger.resolve(i, result)
        if self.tracer is not None:  # P's phases, asked on P's executor: the worker goes on
            self.tracer.legs(i, rep, self.p_pool, self.p_exec[p].submit)
