"""P's WRITEs in flight: post a push's legs, poll them, end each one exactly once.

A push becomes one WRITE per target D rank (a *leg*: this rank's page, or its chunk for that
rank), each carrying its completion notification. ``Legs`` posts them, polls them and ends
them -- completed, failed at post, failed or timed out while polling, or abandoned when the
peer dies -- and has the push settled once its last leg is over (``kvpush.prefill.settle``:
blocks back to the pool, or quarantined until a fence when bytes may still be moving, its
counters, phase stamps and outcome); a coalesced WRITE's pushes are settled together. Fences
(``kvpush.prefill.fences``) are in-flight WRITEs too and end here. Each post's descriptors and
time in NIXL's prep+post calls go to ``kvpush.prefill.lanestats``. State lives in the
``PushTable`` (``Writing``, ``Leg``, ``FenceWrite``); this object only acts on it.

Coalescing (``kvpush.prefill.coalesce``): legs that may share a WRITE wait in ``ready`` for the
pass's end; ``post_ready`` posts each group as one WRITE (a ``Batch``), whose legs each end as if
posted alone.

Nothing here calls back up into the writer: a call that finds a peer to evict, or a push
whose blocks must wait again, returns it as an event (``kvpush.prefill.events``) that the
writer dispatches. Which entries are polled when is the writer's (``check`` polls one).

Thread: the writer's owner thread, only (``PushWriter`` calls it from its passes and
housekeeping); nothing here blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvpush.config import Wire
from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.peers.tp import Slice
from kvpush.prefill import coalesce
from kvpush.prefill.coalesce import Pending, Ready
from kvpush.prefill.context import WriterContext
from kvpush.prefill.events import ENDED, NO_EVENTS, Ended, Event, EvictPeer, Rewait
from kvpush.prefill.fences import Fences, entry_of
from kvpush.prefill.lanestats import PeerLanes
from kvpush.prefill.outcomes import Outcomes
from kvpush.prefill.plan import PlanError, WritePlan, plan_write
from kvpush.prefill.settle import Settler
from kvpush.prefill.table import (
    Batch,
    FenceWrite,
    InFlight,
    Leg,
    Push,
    Registration,
    Writing,
)
from kvpush.ratelog import RateLimitedLog
from kvpush.telemetry.names import Failure, Hist
from kvpush.transport.agent import (
    GONE,
    XFER_DONE,
    XFER_ERR,
    DList,
    TransferError,
    TransferKind,
    XferState,
)
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class Legs:
    def __init__(
        self, ctx: WriterContext, out: Outcomes, fences: Fences, lanes: PeerLanes | None = None
    ) -> None:
        self.cfg = ctx.cfg
        # Held one by one (not through ``ctx``): a push's post and poll read them.
        self._agent = ctx.agent
        self._pool = ctx.pool
        self._table = ctx.table
        self._codec = ctx.codec
        self._tm = ctx.telemetry
        self._hs = ctx.handshakes  # counts transport errors: degraded, then evicted
        self._geom = ctx.geom
        self._out = out
        self._fences = fences
        self._dialect = ctx.dialect  # WRITE deadlines (vLLM's wire: none, no fence ends one)
        self._rl = RateLimitedLog(log)
        self.local_dlist: DList | None = None  # the whole pool's, from open() on
        self._chunk_dlists: dict[tuple[int, int], DList] = {}  # (offset, length) of each page
        self._settler = Settler(ctx, out)  # once every leg of a push ended
        self._lanes = lanes  # per-peer posting figures (``kvpush.prefill.lanestats``)
        # Legs matched in this pass that may share a WRITE (kvpush's wire, --coalesce).
        self.ready = Pending()
        self._coalesce = ctx.cfg.coalesce and ctx.cfg.wire == Wire.KVPUSH

    # ------------------------------------------------------------------ descriptor lists
    def open(self) -> None:
        """Prepare the local descriptor list of the whole pool (the owner thread, at start)."""
        self.local_dlist = self._agent.prep_local(
            self._pool.all_block_descs(), self._pool.device_kind
        )

    def close(self) -> None:
        """Release every local descriptor list (after the last WRITE ended)."""
        for dl in self._chunk_dlists.values():
            self._agent.release_dlist(dl)
        self._chunk_dlists.clear()
        if self.local_dlist is not None:
            self._agent.release_dlist(self.local_dlist)
            self.local_dlist = None

    # ------------------------------------------------------------------ posting
    def start(self, push: Push, conns: dict[int, PeerConn]) -> Sequence[Event]:
        """One WRITE (a leg) per target D rank: this rank's page, or its chunk for that rank.
        ``conns``: a full connection of each, of the incarnation that registered (the writer
        checked). Returns what the writer must do next: the blocks wait again (a forged
        PUSH_REG), or peers to evict (a post failed on their transport)."""
        plans: list[tuple[Registration, PeerConn, WritePlan, DList]] = []
        for r in push.registrations:
            reg, conn = r.reg, conns[r.reg.decode_tp_rank]
            if (
                r.sender
                and r.sender != conn.agent_name
                and not (r.any_rank and r.sender in {c.agent_name for c in conns.values()})
            ):
                # The PUSH_REG did not come from the D it names: a third agent trying to
                # redirect this WRITE into someone else's blocks. Refuse it (no Failure to the
                # real D) and let the blocks wait for the real registration.
                self._tm.fail(Failure.FORGED_NOTIF)
                self._rl.warning(
                    "forged",
                    "PUSH_REG for %s from %s, not from %s: ignored",
                    push.key,
                    r.sender,
                    conn.agent_name,
                )
                return (Rewait(push.finished),)
            sl = conn.write  # computed (and checked) by the full handshake
            assert sl is not None, "a WRITE needs a full P -> D handshake"
            try:
                plan = plan_write(push.finished.block_ids, reg, conn.metadata, self._geom, sl)
            except PlanError as e:
                self._out.fail(push, e.reason, e.detail)
                return NO_EVENTS
            plans.append((r, conn, plan, self._local_slice(sl)))
        # From the first post on, nothing frees these blocks except the completions, a fence
        # or the peers' death (``Writing`` in the table says so); the pool shows them INFLIGHT
        # while a WRITE is still in progress after its post -- a WRITE done at post (small CMA
        # WRITEs often are) goes straight back to free, without the state flip.
        w = Writing(push, unposted=len(plans), t_start=time.monotonic())
        self._table.writing(w)
        evictions: list[Event] | None = None  # (none on the hot path)
        for r, conn, plan, local in plans:
            if self._coalesce and coalesce.coalescable(self.cfg, r, plan):
                self.ready.add(Ready(w, r, conn, plan, local))  # still ``unposted``
                continue
            w.unposted -= 1
            ev = self.post(w, r, conn, plan, local)
            if ev is not None:
                evictions = evictions or []
                evictions.append(ev)
        if not w.unposted:
            self._posted(w)
        return evictions or NO_EVENTS

    def _posted(self, w: Writing) -> None:
        """Every leg of ``w`` was posted (or failed at post)."""
        if w.legs and not w.settled:
            self._pool.allocator.mark_inflight(w.push.key)
        elif not w.legs and not w.settled:  # every leg failed at post, or the last one did
            self._table.forget(w)
            self._settler.settle(w)

    def post_ready(self, group: list[Ready]) -> EvictPeer | None:
        """Post one D rank's ready legs: one alone as ``post`` would, several as one WRITE with
        one ``Completions``. Each push whose last leg this was is then settled or marked."""
        for g in group:
            g.writing.unposted -= 1
        first = group[0]
        if first.conn.evicted:
            # Evicted since matched (a WRITE of this pass failed on it): nothing was posted.
            e = TransferError(TransferKind.PEER_UNKNOWN, "peer evicted before the WRITE")
            for g in group:
                self._post_failed(g.writing, g.registration, g.conn, e)
            ev = None
        elif len(group) == 1:
            ev = self.post(first.writing, first.registration, first.conn, first.plan, first.local)
        else:
            ev = self._post_batch(group)
        for g in group:
            if not g.writing.unposted:
                self._posted(g.writing)
        return ev

    def _post_batch(self, group: list[Ready]) -> EvictPeer | None:
        """Several pushes' legs to one D rank as one WRITE (``kvpush.prefill.coalesce``)."""
        conn = group[0].conn
        lidx, ridx, nbytes = coalesce.indices(group)
        notif = self._codec.encode(coalesce.notification(self.cfg, group))
        assert conn.remote_dlist is not None
        t_post = time.monotonic()
        try:
            xfer, state = self._agent.post_write(
                group[0].local, lidx, conn.remote_dlist, ridx, notif
            )
        except TransferError as e:
            for g in group:
                self._post_failed(g.writing, g.registration, conn, e)
            if self._transport_error(conn, e):
                return EvictPeer(conn.key, f"WRITE post failed: {e.status}", _soft(e))
            return None
        post_s = time.monotonic() - t_post
        if self._lanes is not None:
            self._lanes.posted(conn.key, conn.agent_name, len(lidx), nbytes, post_s)
        deadline = self._dialect.write_deadline(t_post, nbytes, self.cfg.timeouts)
        for g in group:
            g.writing.t_posted = t_post
        legs = [
            Leg(g.writing, g.registration, xfer, conn, t_post, deadline, g.plan.nbytes, post_s)
            for g in group
        ]
        self._track(Batch(xfer, conn, t_post, deadline, nbytes, legs, post_s), state)
        return None

    def _post_failed(self, w: Writing, r: Registration, conn: PeerConn, e: TransferError) -> None:
        """One leg could not be posted: nothing of it can land; its D rank is told."""
        w.failed[r.reg.decode_tp_rank] = (Failure.WRITE_POST_FAILED, False)
        self._out.tell(r, conn, Failure.WRITE_POST_FAILED, str(e), may_have_written=False)
        self._tm.fail(Failure.WRITE_POST_FAILED)

    def _local_slice(self, sl: Slice) -> DList:
        """The local descriptor list of a chunk of every page (prepared once per chunk)."""
        assert self.local_dlist is not None
        if sl.local_offset == 0 and sl.length == self._geom.block_bytes:
            return self.local_dlist
        dl = self._chunk_dlists.get((sl.local_offset, sl.length))
        if dl is None:
            descs = self._pool.slice_descs(sl.local_offset, sl.length)
            dl = self._agent.prep_local(descs, self._pool.device_kind)
            self._chunk_dlists[(sl.local_offset, sl.length)] = dl
        return dl

    def post(
        self, w: Writing, r: Registration, conn: PeerConn, plan: WritePlan, local: DList
    ) -> EvictPeer | None:
        """Post one leg of ``w`` (its completion notification attached); a WRITE done or
        failed at post ends here and then (its peer to evict, when the failure says so)."""
        reg = r.reg
        notif = self._codec.encode(
            protocol.Completion(
                request_id=reg.request_id,
                transfer_id=reg.transfer_id,
                p_tp_size=self.cfg.tp_size,
                p_tp_rank=self.cfg.tp_rank,
                nbytes=plan.nbytes,
            )
        )
        assert conn.remote_dlist is not None
        t_post = time.monotonic()
        try:
            xfer, state = self._agent.post_write(
                local, plan.local_idx, conn.remote_dlist, plan.remote_idx, notif
            )
        except TransferError as e:
            self._post_failed(w, r, conn, e)
            if self._transport_error(conn, e):
                return EvictPeer(conn.key, f"WRITE post failed: {e.status}", _soft(e))
            return None
        post_s = time.monotonic() - t_post
        if self._lanes is not None:
            self._lanes.posted(conn.key, conn.agent_name, len(plan.local_idx), plan.nbytes, post_s)
        deadline = self._dialect.write_deadline(t_post, plan.nbytes, self.cfg.timeouts)
        w.t_posted = t_post
        self._track(Leg(w, r, xfer, conn, t_post, deadline, plan.nbytes, post_s), state)
        return None

    def _track(self, posted: Leg | Batch, state: XferState) -> None:
        """A WRITE just posted, in the table; one that ended at its post (done or failed) is
        settled here and now."""
        self._table.leg_posted(posted)
        if state == XFER_DONE:
            self.complete(posted, at_post=True)
        elif state == XFER_ERR:
            self.abandon(posted, Failure.WRITE_ERROR, "transfer() returned ERR")

    def check(self, entry: InFlight, now: float) -> Ended | EvictPeer | None:
        """Poll one WRITE (or fence): None while in progress; once it ended (completed, failed
        or timed out) ``ENDED``, or the peer to evict when the error says so. The writer
        chooses what to poll when (``PushWriter.poll``, ``housekeeping``)."""
        try:
            st = self._agent.state(entry.xfer)
        except TransferError as e:
            dead = e.kind == TransferKind.PEER_DEAD
            self.abandon(entry, Failure.PEER_DEAD if dead else Failure.WRITE_ERROR, str(e))
            if self._transport_error(entry.conn, e):
                return EvictPeer(entry.conn.key, f"transfer failed: {e.status}", _soft(e))
            return ENDED
        if st == XFER_DONE:
            self.complete(entry)
            self._hs.transport_ok(entry.conn.key)
            return ENDED
        if st == XFER_ERR:
            err = TransferError(TransferKind.XFER_ERROR, "transfer state ERR", "xfer_state_err")
            self.abandon(entry, Failure.WRITE_ERROR, str(err))
        elif now > entry.deadline:
            err = TransferError(
                TransferKind.TIMEOUT,
                f"WRITE of {entry.nbytes} bytes not done after {now - entry.t_post:.1f}s",
                "write_timeout",
            )
            self.abandon(entry, Failure.WRITE_TIMEOUT, str(err))
        else:
            return None
        if self._transport_error(entry.conn, err):
            return EvictPeer(entry.conn.key, f"transfer failed: {err.status}", True)
        return ENDED

    def _transport_error(self, conn: PeerConn, e: TransferError) -> bool:
        """Count ``e`` on ``conn``'s peer; True when the peer must be evicted now."""
        if conn.evicted:
            return False  # already forgotten (an earlier leg's error evicted it)
        return self._hs.transport_error(conn.key, e)

    def complete(self, entry: InFlight, at_post: bool = False) -> None:
        self._agent.release(entry.xfer)
        if isinstance(entry, FenceWrite):
            self._table.done(entry)
            self._fences.completed(entry)
            return
        now = time.monotonic()
        if self._lanes is not None and not at_post:  # (done within its post: the post was all)
            self._lanes.done(entry.conn.key, entry.post_s, now - entry.t_post)
        legs = entry.legs if isinstance(entry, Batch) else [entry]
        if isinstance(entry, Batch):
            self._table.done(entry)  # the WRITE; then each of its legs, in order
        self._tm.observe_many(Hist.WRITE_DURATION, [now - entry.t_post] * len(legs))
        ended = [w for leg in legs if (w := self._leg_done(leg, now)) is not None]
        ok = [w for w in ended if not w.settled and not w.failed]
        if len(ok) > 1:  # a batch's blocks back in one pass (runs joined), before any report
            self._pool.allocator.release_many([w.push.key for w in ok])
            for w in ok:
                w.released = True
        self._settler.settle_many(ended)

    def _leg_done(self, leg: Leg, now: float) -> Writing | None:  # (its push, once all ended)
        leg.writing.nbytes += leg.nbytes
        leg.writing.t_done = now
        return self._table.done(leg)

    def abandon(self, entry: InFlight, reason: Failure, detail: str) -> None:
        """A WRITE leg (or fence) that will not complete normally."""
        released = self._agent.release(entry.xfer)
        dead = reason == Failure.PEER_DEAD
        if isinstance(entry, FenceWrite):
            self._table.done(entry)
            self._fences.failed(entry, peer_dead=dead)
            return
        # Bytes may still be moving unless the peer is gone: quarantine until a fence.
        may_have_written = not dead
        legs = entry.legs if isinstance(entry, Batch) else [entry]
        if not released:
            log.warning("writer: NIXL could not cancel the WRITE of %s; fencing", legs[0].push.key)
        self._table.done(entry)  # a batch fails every leg it carries, each as if alone
        for leg in legs:
            self._out.fail_leg(leg, reason, detail, may_have_written)
            if may_have_written:
                self._fences.add(leg.conn.key, entry_of(leg))
            w = self._table.done(leg)
            if w is not None:
                self._settler.settle(w)

    def peer_unhealthy(self, key: PeerKey, reason: str) -> None:
        """The peer at ``key`` is evicted for transport errors but may be alive (stalled): its
        WRITEs in flight are abandoned as bytes that may still land -- D keeps their blocks
        quarantined, P fences them once it is connected again (``kvpush.prefill.fences``)."""
        for entry in self._table.legs_to(key):
            self.abandon(entry, Failure.WRITE_ERROR, f"peer evicted: {reason}")

    def peer_gone(self, key: PeerKey, reason: str, why: Failure = Failure.PEER_DEAD) -> None:
        """The peer at ``key`` is gone: nothing of its legs can land any more; its fences'
        quarantined blocks come back. Its legs fail with ``why`` (``peer_dead``, or the
        registry's ``peer_left`` / ``peer_restarted``)."""
        for entry in self._table.legs_to(key):
            self._agent.release(entry.xfer)
            if isinstance(entry, FenceWrite):
                self._table.done(entry)
                for e in entry.entries:
                    self._pool.allocator.release_quarantined(e.key)
                continue
            self._table.done(entry)
            for leg in entry.legs if isinstance(entry, Batch) else [entry]:
                self._out.fail_leg(leg, why, reason, may_have_written=False)
                w = self._table.done(leg)
                if w is not None:
                    self._settler.settle(w)


def _soft(e: TransferError) -> bool:
    """An error after which the peer may still be alive (its bytes may still land)."""
    return e.kind not in GONE
