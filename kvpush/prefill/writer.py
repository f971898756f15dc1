"""P's push writer: the one thread that owns WRITE submission and the draining of notifications.

Wake model. The writer sleeps on one ``threading.Event`` shared by its inboxes: *finished* (P's
blocks are ready), *registrations* (PUSH_REGs delivered in-process), *deferred* (pushes whose
P->D handshake completed) and *evictions* (peers to forget). Each pass drains every inbox, polls
NIXL notifications (PUSH_REG, heartbeat, cancel, ping), polls in-flight WRITEs and, every few
milliseconds, expires leases and deadlines. It spins while WRITEs are in flight and backs off
when idle (``IdleWaiter``): with NIXL's progress thread off, this thread's polling *is* progress.

Never blocking on the network. When the P->D handshake is not ready, ``_start_push`` attaches a
done-callback to the handshake future and returns. The callback (on the handshake thread) puts
the push on the *deferred* inbox and wakes the writer; if even that raises, the push goes to a
last-resort list the writer drains, so a request is never lost silently. ``--writer blocking``
instead waits on the future inside the writer: the old head-of-line behaviour, for comparison.

Every failure goes through ``_fail`` (count, rate-limited log, Failure notification to D, blocks
released or quarantined). P's blocks return to the pool when their WRITE completes or their
lease lapses. A WRITE abandoned while its bytes may still be moving quarantines P's blocks and
tells D ``may_have_written``; a fence (a one-block WRITE with a Fence notification, which
completes only after every earlier WRITE to that peer) then frees both sides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np

from kvpush.config import EndpointConfig, HandshakeMode, WriterMode
from kvpush.memory.descriptors import xfer_indices
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import HandshakeManager, PeerConn, PeerKey
from kvpush.prefill.matching import DuplicateError, Finished, Matcher, Push, Registration, reg_key
from kvpush.runtime.inbox import Inbox, drain_into
from kvpush.runtime.owner import IdleWaiter, drain_notifications
from kvpush.runtime.ratelog import RateLimitedLog
from kvpush.telemetry.store import Telemetry
from kvpush.transport.nixl import DList, NixlAgent, TransferError, Xfer
from kvpush.wire import protocol
from kvpush.wire.notifs import NotifCodec

log = logging.getLogger(__name__)

_I = TypeVar("_I")


def _call(task: Callable[[], None]) -> None:
    task()


HOUSEKEEPING_S = 0.02


@dataclass(frozen=True)
class Deferred:
    """A push whose handshake finished (``error`` set when it failed)."""

    push: Push
    error: BaseException | None


@dataclass
class Inflight:
    kind: str  # "push" | "fence"
    key: str
    xfer: Xfer
    conn: PeerConn
    t_post: float
    deadline: float
    nbytes: int
    push: Push | None = None
    fence_keys: list[str] = field(default_factory=list)
    # (quarantined key, D block, D request id) a fence covers: re-queued if it times out
    fence_entries: list[tuple[str, int, str]] = field(default_factory=list)


class PushWriter:
    def __init__(
        self,
        cfg: EndpointConfig,
        agent: NixlAgent,
        pool: KvPool,
        handshakes: HandshakeManager,
        codec: NotifCodec,
        telemetry: Telemetry,
        on_ping: Callable[[str, protocol.Ping], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._agent = agent
        self._pool = pool
        self._hs = handshakes
        self._codec = codec
        self._tm = telemetry
        self._on_ping = on_ping
        self.wake = threading.Event()
        self.finished: Inbox[Finished] = Inbox("finished", 1 << 16, self.wake)
        self.registrations: Inbox[Registration] = Inbox("registrations", 1 << 16, self.wake)
        self.deferred: Inbox[Deferred] = Inbox("deferred", 1 << 16, self.wake)
        self.evictions: Inbox[tuple[PeerKey, str]] = Inbox("evictions", 4096, self.wake)
        # small jobs other threads hand to the writer (it owns the agent's send path)
        self.tasks: Inbox[Callable[[], None]] = Inbox("tasks", 1 << 16, self.wake)
        self._last_resort: deque[tuple[Push, BaseException]] = deque()
        t = cfg.timeouts
        self._matcher = Matcher(lease_s=t.lease_s, reg_ttl_s=t.request_deadline_s)
        self._inflight: dict[int, Inflight] = {}
        self._awaiting_hs: dict[str, Push] = {}  # key -> push waiting for its handshake
        self._cancelled: set[str] = set()
        # per peer: (quarantined key, one of D's blocks of it, D's request id) awaiting a fence;
        # D keys its quarantined requests by request id, P its blocks by transfer key.
        self._fence_pending: dict[PeerKey, list[tuple[str, int, str]]] = {}
        self._waiter = IdleWaiter(self.wake, cfg.agent)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="push-writer", daemon=True)
        self.failure: BaseException | None = None
        self._rl = RateLimitedLog(log)
        self._local_dlist: DList | None = None
        self._regions = pool.cfg.regions
        self._nb = pool.cfg.num_blocks
        self._block_bytes = pool.cfg.block_bytes
        self._next_hk = 0.0
        self._fence_seq = 0
        for name, fn in {
            "finished_waiting_reg": lambda: self._matcher.finished_waiting,
            "regs_waiting_blocks": lambda: self._matcher.regs_waiting,
            "deferred": lambda: len(self._awaiting_hs) + len(self.deferred),
            "inflight_writes": lambda: sum(1 for i in self._inflight.values() if i.kind == "push"),
            "inbox_finished": lambda: len(self.finished),
            "inbox_registrations": lambda: len(self.registrations),
        }.items():
            telemetry.gauge_fn(name, fn)

    # ------------------------------------------------------------------ lifecycle (caller thread)
    def start(self) -> None:
        self._local_dlist = self._agent.prep_local(
            self._pool.all_block_descs(), self._pool.device_kind
        )
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop intake, finish or fail in-flight pushes within ``timeout_s``, then return."""
        self._drain_deadline = time.monotonic() + timeout_s
        self._stopping.set()
        self.wake.set()
        self._thread.join(timeout_s + 5)
        if self._local_dlist is not None and not self._thread.is_alive():
            self._agent.release_dlist(self._local_dlist)
            self._local_dlist = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ in-process intake
    def submit_finished(self, f: Finished) -> None:
        self.finished.put(f)

    def submit_registration(self, r: Registration) -> None:
        self.registrations.put(r)

    # ------------------------------------------------------------------ thread body
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self._pass()
                self._waiter.wait(busy or bool(self._inflight))
            self._drain()
        except BaseException as e:  # surfaced through Endpoint.failure()
            self.failure = e
            log.exception("push writer failed")

    def _pass(self) -> bool:
        n = 0
        n += drain_into(self.finished, lambda f: self._guard(self._on_finished, f, f.key))
        n += drain_into(self.registrations, lambda r: self._guard(self._on_registration, r, r.key))
        n += drain_into(self.deferred, lambda d: self._guard(self._on_deferred, d, d.push.key))
        n += drain_into(self.evictions, lambda e: self._evict(*e))
        n += drain_into(self.tasks, lambda t: self._guard(_call, t, "task"))
        while self._last_resort:
            push, exc = self._last_resort.popleft()
            self._fail(push, "callback_error", f"handshake callback failed: {exc!r}")
            n += 1
        n += self._poll_notifs()
        n += self._poll_inflight()
        now = time.monotonic()
        if now >= self._next_hk:
            self._next_hk = now + HOUSEKEEPING_S
            self._housekeeping(now)
        return n > 0

    def _guard(self, fn: Callable[[_I], None], item: _I, key: str) -> None:
        """Run one item's handler; an unexpected error fails that item, never the thread."""
        try:
            fn(item)
        except Exception as e:
            self._tm.fail("internal_error")
            log.exception("writer: handling %s failed", key)
            push = item.push if isinstance(item, Deferred) else item
            if isinstance(push, Push):
                self._fail(push, "internal_error", repr(e))

    # ------------------------------------------------------------------ arrivals
    def _on_finished(self, f: Finished) -> None:
        if f.key in self._cancelled:
            self._cancelled.discard(f.key)
            self._pool.allocator.release(f.key)
            return
        try:
            push = self._matcher.add_finished(f, time.monotonic())
        except DuplicateError as e:
            self._tm.fail("duplicate_transfer")
            self._rl.warning("dup", "writer: %s", e)
            return
        if push is not None:
            self._start_push(push)

    def _on_registration(self, r: Registration) -> None:
        if r.key in self._cancelled:
            self._cancelled.discard(r.key)
            return
        try:
            push = self._matcher.add_registration(r)
        except DuplicateError as e:
            self._tm.fail("duplicate_registration")
            self._rl.warning("dupreg", "writer: %s", e)
            return
        if push is not None:
            self._start_push(push)

    def _on_deferred(self, d: Deferred) -> None:
        self._awaiting_hs.pop(d.push.key, None)
        if d.push.key in self._cancelled:
            self._cancelled.discard(d.push.key)
            self._release_blocks(d.push.key)
            reg = d.push.registration
            self._ack_cancel(
                protocol.Cancel(request_id=reg.reg.request_id, transfer_id=reg.reg.transfer_id),
                reg.sender,
            )
            return
        if d.error is not None:
            self._fail(d.push, "handshake_failed", str(d.error))
            return
        if self._stopping.is_set():
            self._fail(d.push, "shutting_down", "P is shutting down")
            return
        self._start_push(d.push)

    # ------------------------------------------------------------------ pushing
    def _start_push(self, push: Push) -> None:
        reg = push.registration.reg
        key: PeerKey = (reg.decode_host, reg.decode_port)
        conn = self._hs.get(key)
        if (
            conn is not None
            and reg.decode_incarnation
            and conn.metadata.incarnation != reg.decode_incarnation
        ):
            arrived_wall = time.time() - (time.monotonic() - push.registration.t_arrived)
            if conn.connected_at > arrived_wall:
                # We connected to this incarnation after the PUSH_REG arrived: it comes from
                # an incarnation that has since died. Evicting the live one would fail its
                # pushes; writing would hit blocks that now belong to someone else.
                self._fail(push, "stale_registration", "D restarted after this PUSH_REG")
                return
            # D restarted at the same address: forget the old incarnation first.
            self._evict(key, f"new incarnation {reg.decode_incarnation}")
            conn = None
        if conn is None or conn.remote_dlist is None:
            fut = self._hs.ensure(key, HandshakeMode.FULL)
            if fut is not None:
                if push.attempt >= 3:
                    self._fail(push, "handshake_failed", "peer kept disconnecting")
                    return
                if self.cfg.writer_mode == WriterMode.BLOCKING:
                    # Head-of-line on purpose: every other push waits behind this handshake.
                    try:
                        fut.result(self.cfg.timeouts.handshake_s + 1)
                    except BaseException as e:
                        self._fail(push, "handshake_failed", str(e))
                        return
                else:
                    self._awaiting_hs[push.key] = push
                    nxt = Push(push.finished, push.registration, push.attempt + 1)
                    fut.add_done_callback(partial(self._on_handshake_done, nxt))
                    return
            conn = self._hs.get(key)
            if conn is None or conn.remote_dlist is None:
                self._fail(push, "handshake_failed", "peer not connected after handshake")
                return
        self._post(push, conn)

    def _on_handshake_done(self, push: Push, fut: Future[PeerConn]) -> None:
        """Runs on the handshake thread: queue the push for the writer; never lose it."""
        try:
            exc = fut.exception()
            self.deferred.put(Deferred(push, exc))
        except BaseException as e:
            self._last_resort.append((push, e))
            self.wake.set()

    def _post(self, push: Push, conn: PeerConn) -> None:
        reg = push.registration.reg
        local = push.finished.block_ids
        if reg.decode_incarnation and conn.metadata.incarnation != reg.decode_incarnation:
            # Reconnected to a newer incarnation than the one that registered.
            self._fail(push, "stale_registration", "D restarted after this PUSH_REG")
            return
        sender = push.registration.sender
        if sender and sender != conn.agent_name:
            # The PUSH_REG did not come from the D it names: a third agent trying to redirect
            # this WRITE into someone else's blocks. Refuse it (no Failure to the real D) and
            # let the blocks wait for the real registration.
            self._tm.fail("forged_notif")
            self._rl.warning(
                "forged",
                "PUSH_REG for %s from %s, not from %s: ignored",
                push.key,
                sender,
                conn.agent_name,
            )
            again = self._matcher.add_finished(push.finished, time.monotonic())
            if again is not None:
                self._start_push(again)
            return
        if len(reg.local_block_ids) != 1:
            self._fail(push, "bad_registration", "only one block group is supported")
            return
        remote = np.asarray(reg.local_block_ids[0], dtype=np.int64)
        if len(remote) != len(local):
            # Never write a misaligned prefix (vLLM C3): refuse instead.
            self._fail(
                push,
                "block_count_mismatch",
                f"P finished {len(local)} blocks, D registered {len(remote)}",
            )
            return
        md = conn.metadata
        if len(remote) and (int(remote.max()) >= md.num_blocks or int(remote.min()) < 0):
            self._fail(push, "bad_registration", "D block id outside D's pool")
            return
        assert self._local_dlist is not None and conn.remote_dlist is not None
        lidx = xfer_indices(local, self._nb, self._regions)
        ridx = xfer_indices(remote, md.num_blocks, md.regions)
        nbytes = len(local) * self._regions * self._block_bytes
        notif = self._codec.encode(
            protocol.Completion(
                request_id=reg.request_id,
                transfer_id=reg.transfer_id,
                p_tp_size=self.cfg.tp_size,
                p_tp_rank=self.cfg.tp_rank,
                nbytes=nbytes,
            )
        )
        t_post = time.monotonic()
        try:
            xfer, state = self._agent.post_write(
                self._local_dlist, lidx, conn.remote_dlist, ridx, notif
            )
        except TransferError as e:
            self._fail(push, "write_post_failed", str(e), conn=conn)
            if e.kind in ("peer_dead", "peer_unknown"):
                self._evict(conn.key, f"WRITE post failed: {e.kind}")
            return
        self._pool.allocator.mark_inflight(push.key)
        infl = Inflight(
            kind="push",
            key=push.key,
            xfer=xfer,
            conn=conn,
            t_post=t_post,
            deadline=t_post + self.cfg.timeouts.write_deadline_s(nbytes),
            nbytes=nbytes,
            push=push,
        )
        self._inflight[id(xfer)] = infl
        if state == "DONE":
            self._complete(infl)
        elif state == "ERR":
            self._abandon(infl, "write_error", "transfer() returned ERR")

    def _poll_inflight(self) -> int:
        if not self._inflight:
            return 0
        n = 0
        now = time.monotonic()
        for infl in list(self._inflight.values()):
            try:
                st = self._agent.state(infl.xfer)
            except TransferError as e:
                self._abandon(infl, "peer_dead" if e.kind == "peer_dead" else "write_error", str(e))
                if e.kind == "peer_dead":
                    self._evict(infl.conn.key, "transfer failed: peer disconnected")
                n += 1
                continue
            if st == "DONE":
                self._complete(infl)
                n += 1
            elif st == "ERR":
                self._abandon(infl, "write_error", "transfer state ERR")
                n += 1
            elif now > infl.deadline:
                self._abandon(
                    infl,
                    "write_timeout",
                    f"WRITE of {infl.nbytes} bytes not done after {now - infl.t_post:.1f}s",
                )
                n += 1
        return n

    def _complete(self, infl: Inflight) -> None:
        self._inflight.pop(id(infl.xfer), None)
        self._agent.release(infl.xfer)
        now = time.monotonic()
        if infl.kind == "fence":
            for k in infl.fence_keys:
                self._pool.allocator.release_quarantined(k)
            self._tm.inc("fences_ok")
            return
        push = infl.push
        assert push is not None
        self._pool.allocator.release(infl.key)
        self._tm.inc("pushes_ok")
        self._tm.inc("bytes_pushed", infl.nbytes)
        self._tm.observe("write_duration", now - infl.t_post)
        t_match = max(push.finished.t_finished, push.registration.t_arrived)
        self._tm.observe("push_latency", now - t_match)

    def _abandon(self, infl: Inflight, reason: str, detail: str) -> None:
        """A WRITE (or fence) that will not complete normally."""
        self._inflight.pop(id(infl.xfer), None)
        released = self._agent.release(infl.xfer)
        dead = reason == "peer_dead"
        if infl.kind == "fence":
            self._tm.fail("fence_failed")
            if dead:  # nothing can land any more
                for k in infl.fence_keys:
                    self._pool.allocator.release_quarantined(k)
            else:  # peer stalled (e.g. frozen): fence again later; blocks stay quarantined
                self._fence_pending.setdefault(infl.conn.key, []).extend(infl.fence_entries)
            return
        push = infl.push
        assert push is not None
        # Bytes may still be moving unless the peer is gone: quarantine until a fence.
        may_have_written = not dead
        if not released:
            log.warning("writer: NIXL could not cancel the WRITE of %s; fencing", infl.key)
        self._fail(push, reason, detail, conn=infl.conn, may_have_written=may_have_written)
        if may_have_written:
            blocks = push.registration.reg.local_block_ids[0]
            self._fence_pending.setdefault(infl.conn.key, []).append(
                (infl.key, int(blocks[0]), push.registration.reg.request_id)
            )

    # ------------------------------------------------------------------ failures
    def _fail(
        self,
        push: Push,
        reason: str,
        detail: str,
        *,
        conn: PeerConn | None = None,
        may_have_written: bool = False,
    ) -> None:
        self._tm.fail(reason)
        self._tm.inc("pushes_failed")
        self._rl.warning(reason, "push %s failed (%s): %s", push.key, reason, detail)
        if may_have_written:
            self._pool.allocator.quarantine(push.key, reason)
        else:
            self._pool.allocator.release(push.key)
        reg = push.registration.reg
        if conn is None:
            conn = self._hs.get((reg.decode_host, reg.decode_port))
        if conn is not None:
            self._notify(
                conn,
                protocol.Failure(
                    request_id=reg.request_id,
                    transfer_id=reg.transfer_id,
                    reason=reason,
                    detail=detail[:1000],
                    may_have_written=may_have_written,
                ),
            )

    def _release_blocks(self, key: str) -> None:
        self._pool.allocator.release(key)

    def _notify(self, conn: PeerConn, msg: protocol.Notif) -> bool:
        try:
            self._agent.send_notif(conn.agent_name, self._codec.encode(msg))
            return True
        except TransferError as e:
            self._rl.warning("notify", "notification to %s failed: %s", conn.address, e)
            return False

    # ------------------------------------------------------------------ fences
    def _send_fences(self) -> None:
        """Post one fence per peer with abandoned WRITEs: a one-block WRITE + Fence notif."""
        for key, entries in list(self._fence_pending.items()):
            conn = self._hs.get(key)
            if conn is None or conn.remote_dlist is None:
                continue  # peer gone or reconnecting: _evict releases the blocks
            del self._fence_pending[key]
            if len(entries) > 4096:  # one Fence names at most 4096 requests; the rest next time
                self._fence_pending[key] = entries[4096:]
                entries = entries[:4096]
            keys = [k for k, _, _ in entries]
            request_ids = [rid for _, _, rid in entries]
            # Write one of P's quarantined blocks onto one of D's blocks of the same abandoned
            # request: D keeps those quarantined until this very fence lands.
            # The source only needs to be readable: any of P's blocks will do (P's own block 0
            # when the abandoned requests' blocks are gone); the target is quarantined at D.
            src = np.zeros(1, dtype=np.int64)
            remote_block = entries[0][1]
            for k, rb, _ in entries:
                held = self._pool.allocator.blocks_of(k)
                if len(held):
                    src, remote_block = held[:1], rb
                    break
            self._fence_seq += 1
            fence_id = f"fence-{self._fence_seq}"
            lidx = xfer_indices(src[:1], self._nb, self._regions)[:1]
            ridx = xfer_indices(
                np.asarray([remote_block], dtype=np.int64),
                conn.metadata.num_blocks,
                conn.metadata.regions,
            )[:1]
            notif = self._codec.encode(
                protocol.Fence(fence_id=fence_id, request_ids=request_ids[:4096])
            )
            assert self._local_dlist is not None
            try:
                xfer, st = self._agent.post_write(
                    self._local_dlist, lidx, conn.remote_dlist, ridx, notif
                )
            except TransferError as e:
                self._rl.warning("fence", "fence to %s failed to post: %s", conn.address, e)
                self._fence_pending.setdefault(key, []).extend(entries)
                continue
            t = time.monotonic()
            infl = Inflight(
                kind="fence",
                key=fence_id,
                xfer=xfer,
                conn=conn,
                t_post=t,
                deadline=t + self.cfg.timeouts.fence_s,
                nbytes=self._block_bytes,
                fence_keys=keys,
                fence_entries=entries,
            )
            self._inflight[id(xfer)] = infl
            self._tm.inc("fences_sent")
            if st == "DONE":
                self._complete(infl)

    # ------------------------------------------------------------------ notifications
    def _poll_notifs(self) -> int:
        return drain_notifications(self._agent, self._codec, self._tm, self._rl, self._on_notif)

    def _on_notif(self, sender: str, msg: protocol.Notif) -> None:
        if isinstance(msg, protocol.PushReg):
            self._tm.inc("push_regs_received")
            r = Registration(reg_key(msg), msg, sender, time.monotonic())
            if self._stopping.is_set():
                return
            self._on_registration(r)
        elif isinstance(msg, protocol.Heartbeat):
            self._tm.inc("heartbeats_received")
            self._matcher.renew(list(msg.transfer_ids), time.monotonic())
        elif isinstance(msg, protocol.Cancel):
            self._tm.inc("cancels_received")
            self._on_cancel(msg, sender)
        elif isinstance(msg, protocol.Ping):
            if self._on_ping is not None:
                self._on_ping(sender, msg)
        else:
            self._tm.fail("unexpected_notif")
            self._rl.warning("unexpected", "unexpected %s from %s", type(msg).__name__, sender)

    def _on_cancel(self, msg: protocol.Cancel, sender: str) -> None:
        """D abandoned a request after its PUSH_REG. Drop it; if no byte can land any more,
        acknowledge with Failure(cancelled, may_have_written=False) so D frees its blocks; if a
        WRITE is in flight, its own completion notification tells D when the bytes landed.

        Only the agent that sent the registration may cancel it (a PUSH_REG always precedes its
        Cancel on the same connection): a Cancel from anyone else is counted as forged."""
        key = msg.transfer_id or msg.request_id
        owner = self._registration_sender(key)
        if owner is not None and owner != sender:
            self._tm.fail("forged_notif")
            self._rl.warning("forged", "ignored a Cancel for %s from %s (not its D)", key, sender)
            return
        if owner is None and self._matcher.finished(key) is not None:
            self._tm.fail("forged_notif")  # blocks waiting, but nobody registered them
            self._rl.warning("forged", "ignored a Cancel for unregistered %s from %s", key, sender)
            return
        fin, reg = self._matcher.cancel(key)
        if fin is not None:
            self._pool.allocator.release(key)
        if fin is not None or reg is not None:
            if fin is None and len(self._cancelled) < 100_000:
                # P has not finished its blocks yet: free them when they do, instead of
                # holding them until their lease lapses (a burst of aborts exhausted P).
                self._cancelled.add(key)
            self._ack_cancel(msg, sender)
            return
        if key in self._awaiting_hs:
            self._cancelled.add(key)  # dropped (and acknowledged) when its handshake returns
            return
        for infl in self._inflight.values():
            if infl.kind == "push" and infl.key == key:
                return  # the WRITE's own completion notification tells D when bytes landed
        # Unknown here (finished already, or never seen): nothing will be written for it.
        self._ack_cancel(msg, sender)

    def _registration_sender(self, key: str) -> str | None:
        """The NIXL agent whose PUSH_REG P holds for ``key`` (waiting, deferred or in flight)."""
        r = self._matcher.registration(key)
        if r is not None:
            return r.sender
        push = self._awaiting_hs.get(key)
        if push is not None:
            return push.registration.sender
        for infl in self._inflight.values():
            if infl.kind == "push" and infl.key == key and infl.push is not None:
                return infl.push.registration.sender
        return None

    def _ack_cancel(self, msg: protocol.Cancel, sender: str) -> None:
        """Tell D that nothing was (or will be) written for a cancelled request. Without a
        connection to D yet, handshake to the address the Cancel carries -- in the background,
        like a push -- and acknowledge from this thread once it is up."""
        ack = protocol.Failure(
            request_id=msg.request_id,
            transfer_id=msg.transfer_id,
            reason="cancelled",
            detail="cancel acknowledged; nothing was written",
            may_have_written=False,
        )
        conn = self._hs.by_agent(sender)
        if conn is not None:
            self._notify(conn, ack)
            return
        if not msg.decode_port:
            self._tm.fail("cancel_unacknowledged")
            return
        key: PeerKey = (msg.decode_host, msg.decode_port)
        fut = self._hs.ensure(key, HandshakeMode.FULL)
        if fut is None:
            conn = self._hs.get(key)
            if conn is not None:
                self._notify(conn, ack)
            return

        def done(f: Future[PeerConn]) -> None:  # handshake thread: hand back to the writer
            try:
                if f.exception() is None:
                    self.tasks.put(partial(self._ack_after_handshake, key, ack))
                else:
                    self._tm.fail("cancel_unacknowledged")
            except BaseException:
                self._tm.fail("cancel_unacknowledged")

        fut.add_done_callback(done)

    def _ack_after_handshake(self, key: PeerKey, ack: protocol.Failure) -> None:
        conn = self._hs.get(key)
        if conn is not None:
            self._notify(conn, ack)

    # ------------------------------------------------------------------ peers and housekeeping
    def _evict(self, key: PeerKey, reason: str) -> None:
        conn = self._hs.evict(key, reason)
        for infl in list(self._inflight.values()):
            if infl.conn.key == key:
                self._inflight.pop(id(infl.xfer), None)
                self._agent.release(infl.xfer)
                if infl.kind == "push" and infl.push is not None:
                    self._fail(infl.push, "peer_dead", reason, conn=None)
                else:
                    for k in infl.fence_keys:
                        self._pool.allocator.release_quarantined(k)
        for k, _, _ in self._fence_pending.pop(key, []):
            self._pool.allocator.release_quarantined(k)
        if conn is not None:
            self._hs.release_conn(conn)

    def _housekeeping(self, now: float) -> None:
        fins, regs = self._matcher.expire(now)
        for f in fins:
            self._tm.fail("lease_expired")
            self._rl.warning("lease", "lease of %s lapsed before D registered", f.key)
            self._pool.allocator.release(f.key)
        for r in regs:
            self._tm.fail("registration_expired")
            self._refuse_registration(r, "no_blocks", "P never finished blocks for this transfer")
        if self._fence_pending:
            self._send_fences()
        busy_peers = {i.conn.key for i in self._inflight.values()}
        for key in self._hs.idle(self.cfg.timeouts.peer_idle_ttl_s):
            if key not in busy_peers:
                self._evict(key, "idle")

    def _refuse_registration(self, r: Registration, reason: str, detail: str) -> None:
        """Tell D (when connected) that a registration that never met its blocks is dropped;
        nothing was written, so D can free its blocks at once."""
        conn = self._hs.get((r.reg.decode_host, r.reg.decode_port))
        if conn is not None:
            self._notify(
                conn,
                protocol.Failure(
                    request_id=r.reg.request_id,
                    transfer_id=r.reg.transfer_id,
                    reason=reason,
                    detail=detail,
                ),
            )

    # ------------------------------------------------------------------ shutdown
    def _drain(self) -> None:
        """Stop intake, fail what cannot finish, wait for in-flight WRITEs until the deadline."""
        for f in self.finished.close():
            self._pool.allocator.release(f.key)
        self.registrations.close()
        fins, regs = self._matcher.drain_all()
        for f in fins:
            self._pool.allocator.release(f.key)
        for r in regs:
            self._refuse_registration(r, "shutting_down", "P is shutting down")
        deadline = getattr(self, "_drain_deadline", time.monotonic() + 5)
        while (self._inflight or self._awaiting_hs or len(self.deferred)) and (
            time.monotonic() < deadline
        ):
            drain_into(self.deferred, lambda d: self._guard(self._on_deferred, d, d.push.key))
            self._poll_inflight()
            self._poll_notifs()
            time.sleep(0.0005 if not self._inflight else 0)
        self.deferred.close()
        for infl in list(self._inflight.values()):
            self._abandon(infl, "shutting_down", "P stopped before the WRITE completed")
        for push in list(self._awaiting_hs.values()):
            self._fail(push, "shutting_down", "P stopped while the handshake was pending")
        self._awaiting_hs.clear()
        self.evictions.close()
