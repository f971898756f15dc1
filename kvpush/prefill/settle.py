"""Settling a push whose every leg ended: its blocks back (or kept for a fence), its counters,
histograms and phase stamps, and its outcome to whoever waits for it. Once per push.

``settle_many`` settles the pushes a coalesced WRITE ended together (``kvpush.prefill.legs``):
each exactly as ``settle`` would, with the ok ones' counters bumped once for all of them and
each histogram fed in one call, then their outcomes reported in order -- every push's counters
are bumped before its outcome is out, as for one push alone. A failed push is settled at once by
``Outcomes.settle`` (counted, reported, its blocks quarantined or freed).

Thread: the writer's owner thread, only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kvpush.prefill.context import WriterContext
from kvpush.prefill.outcomes import Outcomes
from kvpush.prefill.table import PushOutcome, Writing
from kvpush.telemetry import phases
from kvpush.telemetry.names import Counter, Hist

log = logging.getLogger(__name__)

_PUSH_LATENCY = Hist.PUSH_LATENCY.value
_MATCH_WAIT = Hist.PHASE_MATCH_WAIT.value


class Settler:
    def __init__(self, ctx: WriterContext, out: Outcomes) -> None:
        self._stamps = ctx.cfg.phase_stamps
        self._pool = ctx.pool
        self._tm = ctx.telemetry
        self._report = ctx.report
        self._hs = ctx.handshakes
        self._agent = ctx.agent
        self._out = out
        self._n_ok = 0  # pushes ok (the drop_agents_after fault hook)
        self._drop_agents_after = ctx.instruments.drop_agents_after

    def settle(self, w: Writing) -> None:
        """Every leg of ``w``'s push ended: the blocks go back (or wait for a fence). Once."""
        self.settle_many((w,))

    def settle_many(self, ws: Iterable[Writing]) -> None:
        """``settle`` of each push, in order (see the module)."""
        now = time.monotonic()
        shift = phases.wall_shift() if self._stamps else 0.0  # (one instant for the batch)
        done: list[PushOutcome] = []
        latency: list[float] = []
        steps: dict[str, list[float]] = {}
        nbytes = 0
        for w in ws:
            if w.settled:
                continue
            w.settled = True
            push = w.push
            if w.failed:
                reason, _ = next(iter(w.failed.values()))
                quarantine = any(may for _, may in w.failed.values())
                self._out.settle(
                    push, reason, f"{len(w.failed)} of its WRITEs failed", quarantine=quarantine
                )
                continue
            if not w.released:  # (a batch's pushes gave theirs back together: ``Legs``)
                self._pool.allocator.release(push.key)
            nbytes += w.nbytes
            t_match, stamps = self._times(w, now, shift, steps)
            done.append(
                PushOutcome(
                    push.finished.transfer_id, True, nbytes=w.nbytes, phases=stamps, peer=push.peer
                )
            )
            latency.append(now - t_match)
        if done:
            self._publish(done, latency, steps, nbytes)

    def _times(
        self, w: Writing, now: float, shift: float, steps: dict[str, list[float]]
    ) -> tuple[float, dict[str, float]]:
        """When ``w``'s push was matched (its blocks and its last PUSH_REG both here), and its
        phase stamps on the wall clock (empty when stamps are off), their steps added to
        ``steps`` by histogram."""
        t_finished = w.push.finished.t_finished
        regs = w.push.registrations
        if len(regs) == 1:
            t_first = t_last = regs[0].t_arrived
        else:
            t_first = min(r.t_arrived for r in regs)
            t_last = max(r.t_arrived for r in regs)
        t_match = max(t_finished, t_last)
        if not self._stamps:
            return t_match, {}
        steps.setdefault(_MATCH_WAIT, []).append(t_match - min(t_finished, t_first))
        stamps = {
            phases.REGISTRATION_MATCHED: t_match + shift,
            phases.HANDSHAKE_DONE: w.t_start + shift,
            phases.WRITE_POSTED: w.t_posted + shift,
            phases.WRITE_DONE: (w.t_done or now) + shift,
        }
        for hist, seconds in phases.steps(stamps, phases.P_STEPS):
            steps.setdefault(hist, []).append(seconds)
        return t_match, stamps

    def _publish(
        self,
        done: list[PushOutcome],
        latency: list[float],
        steps: dict[str, list[float]],
        nbytes: int,
    ) -> None:
        """The ok pushes' counters and histograms, then each one's outcome, in order."""
        tm = self._tm
        tm.inc(Counter.PUSHES_OK, len(done))
        tm.inc(Counter.BYTES_PUSHED, nbytes)
        tm.observe_many(_PUSH_LATENCY, latency)
        for hist, values in steps.items():
            tm.observe_many(hist, values)
        self._fault_hook(len(done))
        for outcome in done:
            self._report(outcome)

    def _fault_hook(self, ok: int) -> None:
        """``drop_agents_after`` (tests): once the n-th push is ok, NIXL forgets every
        connected D's agent under the writer (the transport lost under its connections)."""
        before, self._n_ok = self._n_ok, self._n_ok + ok
        if before < self._drop_agents_after <= self._n_ok:
            for conn in self._hs.connected():
                log.warning("fault injection: NIXL drops the agent of %s", conn.address)
                self._agent.drop_remote_under(conn.agent_name)
