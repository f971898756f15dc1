"""The decode (D) endpoint and its receiver thread.

``decode(transfer_id, P address, num_blocks)`` allocates blocks (all or nothing; refused at once
with ``no_free_blocks``), and hands the request to the *receiver* thread, which owns D's side of
NIXL: it makes sure a notif-only handshake to P exists (deferred through a callback exactly like
P's writer, never blocking), sends PUSH_REG to P, counts completion notifications (expected =
max(1, P_tp / D_tp)), sends heartbeats for waiting requests, and enforces each request's deadline.
A finished request goes to the *completer* thread, which verifies content (optional), returns
the blocks and resolves the caller's future -- so verification never delays notification polling.

Blocks whose push was abandoned while bytes may still land (deadline passed after PUSH_REG, P
reported ``may_have_written``) are quarantined until P's fence (or the WRITE's own completion)
arrives, or until P is gone and removed; never handed to another request before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from kvpush.config import HandshakeMode, parse_address
from kvpush.endpoint.core import Endpoint
from kvpush.errors import (
    KvpushError,
    NoFreeBlocksError,
    PeerUnreachableError,
)
from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.runtime.inbox import Inbox, drain_into
from kvpush.runtime.owner import IdleWaiter, drain_notifications
from kvpush.runtime.ratelog import RateLimitedLog
from kvpush.transport.nixl import TransferError
from kvpush.transport.sidechannel import ReplyFn
from kvpush.wire import protocol

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 0.02


@dataclass
class DRequest:
    request_id: str
    transfer_id: str
    p_key: PeerKey
    block_ids: np.ndarray
    future: Future[protocol.DecodeRep]
    t_start: float
    deadline: float
    state: str = "new"  # new | handshaking | registered | done | abandoned
    expected: int = 1
    received: int = 0
    p_conn: PeerConn | None = None
    attempts: int = 0
    nbytes: int = 0
    seen_from: set[str] = field(default_factory=set)


class DecodeEndpoint(Endpoint):
    role = "decode"

    def _start_role(self) -> None:
        self.wake = threading.Event()
        self.new: Inbox[DRequest] = Inbox("decode-new", 1 << 16, self.wake)
        self.ready: Inbox[tuple[DRequest, BaseException | None]] = Inbox(
            "decode-ready", 1 << 16, self.wake
        )
        self.evictions: Inbox[tuple[PeerKey, str]] = Inbox("decode-evict", 4096, self.wake)
        self.cancels: Inbox[str] = Inbox("decode-cancel", 1 << 16, self.wake)
        self._last_resort: deque[tuple[DRequest, BaseException]] = deque()
        self._reqs: dict[str, DRequest] = {}  # waiting, by request id
        self._abandoned: dict[str, DRequest] = {}  # quarantined, by request id
        self._completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="completer")
        self._waiter = IdleWaiter(self.wake, self.cfg.agent)
        self._rl = RateLimitedLog(log)
        self._next_hk = 0.0
        self._next_hb = 0.0
        self._owner_stop = threading.Event()
        self.receiver_failure: BaseException | None = None
        tm = self.telemetry
        tm.gauge_fn("d_waiting", lambda: len(self._reqs))
        tm.gauge_fn("d_quarantined_requests", lambda: len(self._abandoned))
        tm.gauge_fn("inbox_decode_new", lambda: len(self.new))
        self._thread = threading.Thread(target=self._run, name="decode-receiver", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def decode(
        self,
        transfer_id: str,
        prefill_address: str,
        num_blocks: int,
        deadline_s: float = 0.0,
        request_id: str = "",
    ) -> Future[protocol.DecodeRep]:
        """Register ``num_blocks`` blocks with P for ``transfer_id``; the future resolves with a
        ``DecodeRep`` (outcome ok or failed with a reason) -- it never raises for peer failures."""
        p_key = parse_address(prefill_address)
        rid = request_id or transfer_id
        fut: Future[protocol.DecodeRep] = Future()
        t0 = time.monotonic()
        if self._stopping.is_set():
            fut.set_result(self._rep_failed(rid, transfer_id, "shutting_down", "D is stopping", t0))
            return fut
        assert self.pool is not None
        if rid in self._reqs or rid in self._abandoned:
            fut.set_result(
                self._rep_failed(rid, transfer_id, "duplicate_request", "request id in use", t0)
            )
            return fut
        try:
            ids = self.pool.allocator.allocate(rid, num_blocks)
        except NoFreeBlocksError as e:
            self.telemetry.fail("no_free_blocks")
            fut.set_result(self._rep_failed(rid, transfer_id, "no_free_blocks", str(e), t0))
            return fut
        except ValueError as e:
            fut.set_result(self._rep_failed(rid, transfer_id, "bad_request", str(e), t0))
            return fut
        dl = deadline_s if deadline_s > 0 else self.cfg.timeouts.request_deadline_s
        req = DRequest(
            request_id=rid,
            transfer_id=transfer_id,
            p_key=p_key,
            block_ids=ids,
            future=fut,
            t_start=t0,
            deadline=t0 + dl,
            nbytes=num_blocks * self.cfg.pool.bytes_per_block_all_regions,
        )
        try:
            self.new.put(req)
        except KvpushError as e:
            self.pool.allocator.release(rid)
            fut.set_result(self._rep_failed(rid, transfer_id, "overloaded", str(e), t0))
        return fut

    def cancel(self, request_id: str) -> None:
        """Abort a waiting request (D-side abort). If its PUSH_REG went out, P is told to drop
        it and the blocks stay quarantined until P's WRITE completion or fence says no more
        bytes can land (vLLM's C1: never hand them to the next request before)."""
        self.cancels.put(request_id)

    def _on_cancel(self, request_id: str) -> None:
        req = self._reqs.get(request_id)
        if req is not None:
            self._finish_failed(req, "cancelled", "cancelled by D", notify_p=True)

    def _rep_failed(
        self, rid: str, tid: str, reason: str, detail: str, t0: float
    ) -> protocol.DecodeRep:
        self.telemetry.inc("requests_failed")
        return protocol.DecodeRep(
            transfer_id=tid,
            request_id=rid,
            outcome="failed",
            reason=reason,
            detail=detail[:1000],
            latency_s=time.monotonic() - t0,
        )

    def _handle_role_request(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        if isinstance(req, protocol.DecodeReq):
            addr = f"{req.prefill_host}:{req.prefill_port}"
            if ":" in req.prefill_host:
                addr = f"[{req.prefill_host}]:{req.prefill_port}"
            fut = self.decode(req.transfer_id, addr, req.num_blocks, req.deadline_s, req.request_id)
            rid = req.rid

            def done(f: Future[protocol.DecodeRep]) -> None:
                rep = f.result()
                reply(
                    protocol.DecodeRep(
                        rid=rid,
                        transfer_id=rep.transfer_id,
                        request_id=rep.request_id,
                        outcome=rep.outcome,
                        reason=rep.reason,
                        detail=rep.detail,
                        latency_s=rep.latency_s,
                        nbytes=rep.nbytes,
                        verified=rep.verified,
                    )
                )

            fut.add_done_callback(done)
            return
        super()._handle_role_request(req, reply)

    # ------------------------------------------------------------------ receiver thread
    def _run(self) -> None:
        try:
            while not self._owner_stop.is_set():
                busy = self._pass()
                self._waiter.wait(busy)
        except BaseException as e:
            self.receiver_failure = e
            log.exception("decode receiver failed")

    def _pass(self) -> bool:
        n = 0
        n += drain_into(self.new, self._on_new)
        n += drain_into(self.ready, lambda item: self._on_ready(*item))
        n += drain_into(self.evictions, lambda e: self._evict(*e))
        n += drain_into(self.cancels, self._on_cancel)
        while self._last_resort:
            req, exc = self._last_resort.popleft()
            self._finish_failed(req, "callback_error", repr(exc))
            n += 1
        n += self._poll_notifs()
        now = time.monotonic()
        if now >= self._next_hk:
            self._next_hk = now + HOUSEKEEPING_S
            self._housekeeping(now)
        return n > 0

    def _on_new(self, req: DRequest) -> None:
        self._reqs[req.request_id] = req
        self._connect_and_register(req)

    def _connect_and_register(self, req: DRequest) -> None:
        assert self.handshakes is not None
        conn = self.handshakes.get(req.p_key)
        mode = self.cfg.handshake_mode
        if conn is None or (mode == HandshakeMode.FULL and conn.mode != HandshakeMode.FULL):
            fut = self.handshakes.ensure(req.p_key, mode)
            if fut is not None:
                req.state = "handshaking"
                fut.add_done_callback(partial(self._on_handshake_done, req))
                return
            conn = self.handshakes.get(req.p_key)
        if conn is None:
            self._finish_failed(req, "handshake_failed", "P not connected after handshake")
            return
        self._register(req, conn)

    def _on_handshake_done(self, req: DRequest, fut: Future[PeerConn]) -> None:
        try:
            self.ready.put((req, fut.exception()))
        except BaseException as e:
            self._last_resort.append((req, e))
            self.wake.set()

    def _on_ready(self, req: DRequest, error: BaseException | None) -> None:
        if req.state == "done":
            return
        if error is not None:
            # Typed, not by message text: "did not accept a connection" is unreachable too.
            unreachable = isinstance(error, PeerUnreachableError)
            reason = "prefill_unreachable" if unreachable else "handshake_failed"
            self._finish_failed(req, reason, str(error))
            return
        self._connect_and_register(req)

    def _register(self, req: DRequest, conn: PeerConn) -> None:
        assert self.metadata is not None
        md = self.metadata
        req.p_conn = conn
        req.expected = max(1, conn.metadata.tp_size // max(1, self.cfg.tp_size))
        reg = protocol.PushReg(
            request_id=req.request_id,
            transfer_id=req.transfer_id,
            decode_engine_id=md.engine_id,
            decode_host=md.host,
            decode_port=md.port,
            decode_tp_size=md.tp_size,
            local_block_ids=[req.block_ids.tolist()],
            remote_engine_id=conn.metadata.engine_id,
            remote_host=req.p_key[0],
            remote_port=req.p_key[1],
            remote_tp_size=conn.metadata.tp_size,
            remote_pp_size=1,
            decode_incarnation=self.incarnation,
            decode_tp_rank=md.tp_rank,
        )
        assert self.agent is not None
        try:
            self.agent.send_notif(conn.agent_name, self.codec.encode(reg))
        except TransferError as e:
            if e.kind in ("peer_dead", "peer_unknown") and req.attempts < 1:
                # P restarted or vanished: forget it and handshake afresh once.
                req.attempts += 1
                self._evict(req.p_key, f"PUSH_REG failed: {e.kind}", keep=req.request_id)
                self._connect_and_register(req)
                return
            self._finish_failed(req, "prefill_unreachable", str(e))
            return
        req.state = "registered"
        self.telemetry.inc("push_regs_sent")

    # ------------------------------------------------------------------ notifications
    def _poll_notifs(self) -> int:
        assert self.agent is not None
        return drain_notifications(self.agent, self.codec, self.telemetry, self._rl, self._on_notif)

    def _from_p(self, req: DRequest, sender: str) -> bool:
        """Only the P agent a request registered with may complete or fail it."""
        if req.p_conn is not None and req.p_conn.agent_name == sender:
            return True
        self.telemetry.fail("forged_notif")
        self._rl.warning(
            "forged", "ignored a notification for %s from %s (not its P)", req.request_id, sender
        )
        return False

    def _on_notif(self, sender: str, msg: protocol.Notif) -> None:
        if isinstance(msg, protocol.Completion):
            req = self._reqs.get(msg.request_id)
            if req is not None:
                if not self._from_p(req, sender):
                    return
                req.received += 1
                if req.received >= req.expected:
                    self._finish_ok(req)
                return
            ab = self._abandoned.get(msg.request_id)
            if ab is not None and self._from_p(ab, sender):
                # The abandoned WRITE completed: its bytes have landed, the blocks are safe.
                self._release_abandoned(ab, "completed late")
                return
            self.telemetry.fail("unknown_completion")
        elif isinstance(msg, protocol.Failure):
            req = self._reqs.get(msg.request_id)
            if req is None:
                ab = self._abandoned.get(msg.request_id)
                if ab is not None and not msg.may_have_written and self._from_p(ab, sender):
                    self._release_abandoned(ab, f"P: {msg.reason}")  # e.g. cancel acknowledged
                return
            if not self._from_p(req, sender):
                return
            self._finish_failed(
                req, msg.reason, msg.detail, quarantine=msg.may_have_written, notify_p=False
            )
        elif isinstance(msg, protocol.Fence):
            self.telemetry.inc("fences_received")
            for rid in msg.request_ids:
                ab = self._abandoned.get(rid)
                if ab is not None and self._from_p(ab, sender):
                    self._release_abandoned(ab, "fenced")
        elif isinstance(msg, protocol.Ping):
            self._on_ping(sender, msg)
        else:
            self.telemetry.fail("unexpected_notif")

    # ------------------------------------------------------------------ outcomes
    def _finish_ok(self, req: DRequest) -> None:
        del self._reqs[req.request_id]
        req.state = "done"
        self._completer.submit(self._complete, req)

    def _complete(self, req: DRequest) -> None:
        """Completer thread: verify, give the blocks back, resolve the future."""
        assert self.pool is not None
        verified: bool | None = None
        try:
            if self.cfg.verify:
                verified = self.pool.verify(req.transfer_id, req.block_ids)
        except Exception:  # a verification bug must still resolve the request
            log.exception("verification of %s failed", req.request_id)
            verified = False
        finally:
            self.pool.allocator.release(req.request_id)
        latency = time.monotonic() - req.t_start
        if verified is False:
            self.telemetry.fail("verify_failed")
            self.telemetry.inc("requests_failed")
            rep = protocol.DecodeRep(
                transfer_id=req.transfer_id,
                request_id=req.request_id,
                outcome="failed",
                reason="verify_failed",
                detail="received bytes differ from the transfer's pattern",
                latency_s=latency,
                nbytes=req.nbytes,
                verified=False,
            )
        else:
            self.telemetry.inc("requests_ok")
            self.telemetry.inc("bytes_received", req.nbytes)
            self.telemetry.observe("decode_latency", latency)
            rep = protocol.DecodeRep(
                transfer_id=req.transfer_id,
                request_id=req.request_id,
                outcome="ok",
                latency_s=latency,
                nbytes=req.nbytes,
                verified=verified,
            )
        req.future.set_result(rep)

    def _finish_failed(
        self,
        req: DRequest,
        reason: str,
        detail: str,
        *,
        quarantine: bool = False,
        notify_p: bool = True,
    ) -> None:
        """Fail a request now. Blocks are quarantined when bytes may still land."""
        assert self.pool is not None and self.agent is not None
        self._reqs.pop(req.request_id, None)
        was_registered = req.state == "registered"
        req.state = "done"
        self.telemetry.fail(reason)
        self._rl.warning(reason, "request %s failed (%s): %s", req.request_id, reason, detail)
        if was_registered and notify_p and req.p_conn is not None:
            # Tell P to drop it; P's WRITE completion (or fence) tells us when bytes stop.
            with contextlib.suppress(TransferError):
                self.agent.send_notif(
                    req.p_conn.agent_name,
                    self.codec.encode(
                        protocol.Cancel(
                            request_id=req.request_id,
                            transfer_id=req.transfer_id,
                            decode_host=self.cfg.host,
                            decode_port=self.metadata.port if self.metadata else 0,
                        )
                    ),
                )
            quarantine = True
        if quarantine and req.p_conn is not None:
            self.pool.allocator.quarantine(req.request_id, reason)
            req.state = "abandoned"
            self._abandoned[req.request_id] = req
        else:
            self.pool.allocator.release(req.request_id)
        req.future.set_result(
            self._rep_failed(req.request_id, req.transfer_id, reason, detail, req.t_start)
        )

    def _release_abandoned(self, req: DRequest, why: str) -> None:
        assert self.pool is not None
        self._abandoned.pop(req.request_id, None)
        self.pool.allocator.release_quarantined(req.request_id)
        self.telemetry.inc("quarantine_released")
        log.debug("blocks of %s released (%s)", req.request_id, why)

    # ------------------------------------------------------------------ housekeeping
    def _housekeeping(self, now: float) -> None:
        for req in [r for r in self._reqs.values() if now > r.deadline]:
            self._finish_failed(
                req, "deadline", f"no KV after {now - req.t_start:.1f}s", notify_p=True
            )
        if now >= self._next_hb:
            self._next_hb = now + self.cfg.timeouts.heartbeat_s
            self._heartbeat()
        assert self.handshakes is not None
        busy = {r.p_key for r in self._reqs.values()} | {r.p_key for r in self._abandoned.values()}
        for key in self.handshakes.idle(self.cfg.timeouts.peer_idle_ttl_s):
            if key not in busy:
                self._evict(key, "idle")

    def _heartbeat(self) -> None:
        by_p: dict[str, tuple[PeerConn, list[str]]] = {}
        for r in self._reqs.values():
            if r.state == "registered" and r.p_conn is not None:
                by_p.setdefault(r.p_conn.agent_name, (r.p_conn, []))[1].append(r.transfer_id)
        assert self.agent is not None
        for conn, tids in by_p.values():
            for i in range(0, len(tids), 4096):
                try:
                    self.agent.send_notif(
                        conn.agent_name,
                        self.codec.encode(protocol.Heartbeat(transfer_ids=tids[i : i + 4096])),
                    )
                    self.telemetry.inc("heartbeats_sent")
                except TransferError as e:
                    if e.kind == "peer_dead":
                        self._evict(conn.key, "heartbeat failed: P disconnected")
                        break

    def _evict(self, key: PeerKey, reason: str, keep: str = "") -> None:
        """P is gone (or restarted): fail its requests, free its quarantined blocks."""
        assert self.handshakes is not None and self.pool is not None
        conn = self.handshakes.evict(key, reason)
        for r in [r for r in self._reqs.values() if r.p_key == key and r.request_id != keep]:
            if r.state == "registered":
                r.p_conn = None  # P is gone: nothing can land any more
                self._finish_failed(r, "prefill_dead", reason, notify_p=False)
        for ab in [a for a in self._abandoned.values() if a.p_key == key]:
            self._release_abandoned(ab, "P removed")
        if conn is not None:
            self.handshakes.release_conn(conn)

    # ------------------------------------------------------------------ shutdown
    def _poke_owner(self) -> None:
        self.wake.set()

    def _stop_role_intake(self, drain_s: float) -> None:
        if not hasattr(self, "_thread"):
            return
        deadline = time.monotonic() + drain_s
        # Waiting requests get until the drain deadline to receive their KV.
        while self._reqs and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)

    def _stop_role(self, drain_s: float) -> None:
        if not hasattr(self, "_thread"):
            return
        self._owner_stop.set()
        self.wake.set()
        self._thread.join(5)
        for req in list(self._reqs.values()):
            self._finish_failed(req, "shutting_down", "D stopped", notify_p=True)
        for req in self.new.close():
            assert self.pool is not None
            self.pool.allocator.release(req.request_id)
            req.future.set_result(
                self._rep_failed(
                    req.request_id, req.transfer_id, "shutting_down", "D stopped", req.t_start
                )
            )
        self._completer.shutdown(wait=True)

    def _role_failure(self) -> BaseException | None:
        return getattr(self, "receiver_failure", None)
