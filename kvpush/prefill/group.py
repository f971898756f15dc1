"""P's side-channel requests, served for every tensor-parallel rank at once.

A prefill leg names one transfer; each rank holds its share of it (its heads). ``PrefillGroup``
reserves blocks on every rank first (all or nothing: a rank without room frees the others' at
once), then fills and finishes each rank's share, and answers once all are handed to their
writers (``finish``, a load generator's: the same without the pattern). A push wait answers
when every rank's push of the transfer ended: ok only when all are ok, else the first failed
rank's reason, named; its deadline is an entry of one timer heap (``kvpush.runtime.timers``),
capped (``kvpush.prefill.limits``). It asks each rank's role, never the role's writer. A traced
request (``--otlp-traces-endpoint``) is handed to ``kvpush.prefill.spans``. Runs on
the control executor (prefill) or the side-channel thread, the writers' threads and the timer
thread (waits).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from kvpush.config import Role
from kvpush.errors import KvpushError, NoFreeBlocksError, RankFailedError, ShuttingDownError
from kvpush.prefill.limits import MAX_DECLINED_IDS, MAX_PUSH_WAITS
from kvpush.prefill.role import PrefillRole
from kvpush.prefill.spans import PrefillSpans
from kvpush.prefill.table import PushOutcome
from kvpush.runtime.timers import Timer, Timers
from kvpush.telemetry import phases
from kvpush.telemetry.names import Counter, Failure
from kvpush.telemetry.store import Telemetry
from kvpush.transport.sidechannel import ReplyFn
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class PrefillGroup:
    def __init__(self, roles: list[PrefillRole], telemetry: Telemetry | None = None) -> None:
        self.roles = roles
        self.telemetry = telemetry  # request-level counts when there is more than one rank
        self._lock = threading.Lock()
        self._digests: OrderedDict[str, str] = OrderedDict()
        self._timers = Timers("push-waits", MAX_PUSH_WAITS)
        self._queued = [0] * len(roles)  # declined ids handed to each writer, not taken in yet
        self.spans = PrefillSpans.of(roles)  # --otlp-traces-endpoint (None: off)

    def handle(self, req: protocol.SideRequest, reply: ReplyFn) -> bool:
        if isinstance(req, protocol.PrefillReq):
            t0 = self.spans.traced(req) if self.spans is not None else 0.0
            self.roles[0].ctx.control.submit(self._serve_prefill, req, reply, t0)
            return True
        if isinstance(req, protocol.PushWaitReq):
            self._serve_wait(req, reply)
            return True
        if isinstance(req, protocol.DeclineReq) and req.origin == Role.DECODE:
            tids = [req.transfer_id, *req.also]
            with self._lock:
                # Remembered by the writers, plus handed to them and not taken in yet (the
                # roles read their writers' counts off the writers' threads: a little stale).
                held = max(
                    role.declines_held() + self._queued[r] for r, role in enumerate(self.roles)
                )
                if held + len(tids) <= MAX_DECLINED_IDS:
                    for r in range(len(self.roles)):
                        self._queued[r] += len(tids)
            if held + len(tids) > MAX_DECLINED_IDS:
                self._limit(Failure.TOO_MANY_DECLINED)
                reply(
                    protocol.ErrorRep(
                        rid=req.rid,
                        code=Failure.TOO_MANY_DECLINED,
                        message=f"{held} declined transfers already remembered "
                        f"(at most {MAX_DECLINED_IDS}); these {len(tids)} are not",
                        hint="P still frees their blocks when their lease lapses",
                    )
                )
                return True
            for r, role in enumerate(self.roles):
                role.ctx.telemetry.inc(Counter.DECLINES_RECEIVED, len(tids))
                taken = functools.partial(self._taken, r, len(tids))
                try:
                    role.declined_by_d(tids, req.reason, req.detail, taken)
                except KvpushError:  # a closed or full inbox: nothing of it is held
                    taken()
                    raise
            reply(protocol.DeclineRep(rid=req.rid, ended=len(self.roles) * len(tids)))
            return True
        return False

    def _refuse(self, transfer_id: str, reason: Failure, detail: str) -> None:
        """P will not serve ``transfer_id``: every rank tells the D ranks that registered."""
        for role in self.roles:
            with contextlib.suppress(KvpushError):  # a closed inbox: that rank is stopping
                role.refused_by_p(transfer_id, reason, detail)

    # ------------------------------------------------------------------ prefill
    def prefill(
        self, transfer_id: str, num_blocks: int, request_id: str = "", digest: bool = False
    ) -> tuple[list[int], str]:
        """Every rank's share of a transfer, reserved all or nothing, filled and finished.
        Returns rank 0's block ids and the sha256 of the filled bytes when ``digest``: over
        region, then block, then rank order -- the model's page, whatever the TP size.
        A refusal (no free blocks, stopping, a failed rank) is told to the D ranks that
        registered for the transfer, or will, at once (``_refuse``)."""
        ids, sha = self._prefill_or_refuse(transfer_id, num_blocks, request_id, digest, True)
        return ids.tolist(), sha

    def finish(self, transfer_id: str, num_blocks: int, request_id: str = "") -> None:
        """``prefill`` without the pattern: every rank's blocks reserved all or nothing and
        handed to its writer as they are -- the stand-in for a model that has just computed its
        KV, for timed load whose D does not verify (a load generator's, ``Endpoint.finish``)."""
        self._prefill_or_refuse(transfer_id, num_blocks, request_id, False, False)

    def _prefill_or_refuse(
        self, transfer_id: str, num_blocks: int, request_id: str, digest: bool, fill: bool
    ) -> tuple[np.ndarray, str]:
        try:
            return self._prefill(transfer_id, num_blocks, request_id, digest, fill)
        except (NoFreeBlocksError, ShuttingDownError, RankFailedError) as e:
            self._refuse(transfer_id, _reason(e), e.message)
            raise

    def _prefill(
        self, transfer_id: str, num_blocks: int, request_id: str, digest: bool, fill: bool
    ) -> tuple[np.ndarray, str]:
        self._check_ranks()
        reserved: list[tuple[PrefillRole, np.ndarray]] = []
        try:
            for role in self.roles:
                reserved.append((role, role.reserve(transfer_id, num_blocks)))
            if fill:
                for role, ids in reserved:
                    role.fill(transfer_id, ids)
            sha = self._digest(reserved) if digest else ""
        except BaseException:
            for role, _ in reserved:
                role.unreserve(transfer_id)
            raise
        for role, ids in reserved:
            role.finish(transfer_id, ids, request_id)
        if self.telemetry is not None:
            self.telemetry.inc(Counter.PREFILLS)
        if sha:
            self._remember_digest(transfer_id, sha)
        return reserved[0][1], sha

    def _check_ranks(self) -> None:
        """Refuse every new transfer once any rank's loop failed."""
        for r, role in enumerate(self.roles):
            err = role.failure()
            if err is not None:
                raise RankFailedError(
                    f"P rank {r} failed ({type(err).__name__}: {err}): this endpoint serves "
                    "no request any more",
                    "restart it; its log has the failure",
                )

    def _remember_digest(self, transfer_id: str, sha: str) -> None:
        with self._lock:
            self._digests[transfer_id] = sha
            while len(self._digests) > 4096:
                self._digests.popitem(last=False)

    def _digest(self, reserved: list[tuple[PrefillRole, np.ndarray]]) -> str:
        role0 = reserved[0][0]
        if len(reserved) == 1:
            return role0.ctx.pool.digest(reserved[0][1])
        h = hashlib.sha256()
        cfg = role0.ctx.cfg.pool
        sharers = reserved[:1] if cfg.replicated else reserved  # replicated: one copy
        for r in range(cfg.regions):
            for j in range(len(reserved[0][1])):
                for role, ids in sharers:
                    h.update(np.ascontiguousarray(role.ctx.pool.page(r, int(ids[j]))).data)
        return h.hexdigest()

    def _serve_prefill(self, req: protocol.PrefillReq, reply: ReplyFn, traced: float) -> None:
        """``traced``: when a traced request arrived (0.0: not traced)."""
        t0 = time.perf_counter()
        try:
            ids, sha = self.prefill(req.transfer_id, req.num_blocks, req.request_id, req.digest)
        except KvpushError as e:
            reply(_failed(req, _reason(e), e.message))
            self._traced_refusal(req, traced, _reason(e), e.message)
            return
        except Exception as e:
            log.exception("prefill %s failed", req.transfer_id)
            detail = f"{type(e).__name__}: {e}"
            reply(_failed(req, Failure.INTERNAL_ERROR, detail))
            self._refuse(req.transfer_id, Failure.INTERNAL_ERROR, detail)
            self._traced_refusal(req, traced, Failure.INTERNAL_ERROR, detail)
            return
        if traced and self.spans is not None:
            self.spans.filled(req, traced)
        role0 = self.roles[0]
        vllm_wire = role0.ctx.dialect.kv_transfer_params
        reply(
            protocol.PrefillRep(
                rid=req.rid,
                transfer_id=req.transfer_id,
                outcome="ok",
                latency_s=time.perf_counter() - t0,
                sha256=sha,
                kv_transfer_params=(
                    role0.kv_transfer_params(req.transfer_id, ids) if vllm_wire else {}
                ),
            )
        )

    def _traced_refusal(
        self, req: protocol.PrefillReq, traced: float, reason: str, detail: str
    ) -> None:
        if traced and self.spans is not None:
            self.spans.refused(req, traced, reason, detail)

    # ------------------------------------------------------------------ push waits
    def _unwatch(self, transfer_id: str) -> None:
        for role in self.roles:
            role.unwatch(transfer_id)

    def _serve_wait(self, req: protocol.PushWaitReq, reply: ReplyFn) -> None:
        """Answer when every rank's push of the transfer ended, or "pending" at ``timeout_s``.

        A wait is one entry of the group's timer heap (no thread); at ``MAX_PUSH_WAITS``
        waiting at once, one more is refused at once with ``too_many_waits``."""
        sent = threading.Event()
        lock = threading.Lock()
        futs = [role.watch(req.transfer_id) for role in self.roles]
        timers: list[Timer] = []

        def answer(timed_out: bool) -> None:
            with lock:
                if sent.is_set() or (not timed_out and not all(f.done() for f in futs)):
                    return
                sent.set()
                for t in timers:
                    t.cancel()
            if not all(f.done() for f in futs):
                self._unwatch(req.transfer_id)
                reply(
                    protocol.PushWaitRep(
                        rid=req.rid, transfer_id=req.transfer_id, outcome="pending"
                    )
                )
                return
            reply(self._wait_rep(req, [f.result() for f in futs]))

        if all(f.done() for f in futs):  # the usual case for drive --trace: no timer at all
            answer(False)
            return
        with lock:
            timer = self._timers.add(req.timeout_s, lambda: answer(True))
            if timer is not None:
                timers.append(timer)
        if timer is None:
            self._unwatch(req.transfer_id)
            self._limit(Failure.TOO_MANY_WAITS)
            reply(
                protocol.ErrorRep(
                    rid=req.rid,
                    code=Failure.TOO_MANY_WAITS,
                    message=f"{MAX_PUSH_WAITS} push waits already waiting",
                    hint="retry when some have been answered, or wait with a shorter timeout_s",
                )
            )
            return
        for f in futs:
            f.add_done_callback(lambda _f: answer(False))

    def _wait_rep(self, req: protocol.PushWaitReq, outs: list[PushOutcome]) -> protocol.PushWaitRep:
        bad = [(r, o) for r, o in enumerate(outs) if not o.ok]
        with self._lock:
            sha = self._digests.get(req.transfer_id, "")
        if bad:
            r, o = bad[0]
            detail = o.detail if len(outs) == 1 else f"rank {r}: {o.detail}"
            return protocol.PushWaitRep(
                rid=req.rid,
                transfer_id=req.transfer_id,
                outcome="failed",
                reason=o.reason,
                detail=detail[:1000],
                nbytes=sum(o.nbytes for o in outs),
            )
        return protocol.PushWaitRep(
            rid=req.rid,
            transfer_id=req.transfer_id,
            outcome="ok",
            nbytes=sum(o.nbytes for o in outs),
            sha256=sha,
            phases=phases.merge(o.phases for o in outs),
        )

    def _taken(self, r: int, n: int) -> None:
        with self._lock:
            self._queued[r] -= n

    def _limit(self, kind: Failure) -> None:
        """A cap was hit: counted once, on rank 0 (the endpoint's first telemetry)."""
        self.roles[0].ctx.telemetry.fail(kind)

    def close(self) -> None:
        """Stop the timer thread (pending waits are not answered: the side channel is down);
        traces (if on) linger through the drain."""
        self._timers.close()
        if self.spans is not None:
            self.spans.close()


def _reason(e: KvpushError) -> Failure:
    if isinstance(e, NoFreeBlocksError):
        return Failure.NO_FREE_BLOCKS
    if isinstance(e, ShuttingDownError):
        return Failure.SHUTTING_DOWN
    if isinstance(e, RankFailedError):
        return Failure.RANK_FAILED
    return Failure.BAD_REQUEST


def _failed(req: protocol.PrefillReq, reason: Failure, detail: str) -> protocol.PrefillRep:
    return protocol.PrefillRep(
        rid=req.rid,
        transfer_id=req.transfer_id,
        outcome="failed",
        reason=reason,
        detail=detail[:1000],
    )


__all__ = ["PrefillGroup"]
