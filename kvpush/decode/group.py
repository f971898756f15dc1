"""D's side-channel requests, served for every tensor-parallel rank at once.

A decode request names one transfer; each D rank receives its share of it (its heads, or the
whole latent when replicated) from the P ranks that write into it. ``DecodeGroup`` starts the
request on every rank under one request id (vLLM's workers share their engine's), and answers
once: ok when every rank's share landed and verified; at the first rank that fails, failed with
that rank's reason (named) -- the other ranks' shares are cancelled at once, so their P ranks
stop and their blocks come back (quarantined until P says no byte can land, as for any cancel).

A request comes in as one frozen ``DecodeOrder`` (``submit``; ``decode`` is the plain kvpush
request) and each rank gets its share of it whole (``DecodeOrder.for_rank``). The ranks' answers
meet in a ``TpJoin`` (``kvpush.decode.join``: pure, it decides); this module acts on what it
decides (answer, cancel the other ranks, free the shares held for a digest) from the thread
that resolved the last share it needed, under one lock per request.

Request-level counters (requests ok/failed, decode latency) are counted here, once per request;
each rank's own telemetry counts its share. Holds no request state beyond the futures it joins.
A traced request (``--otlp-traces-endpoint``) is handed to ``kvpush.decode.spans`` once answered.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import secrets
import threading
import time
from concurrent.futures import Future

import msgspec

from kvpush.config import Role
from kvpush.decode.join import TpJoin
from kvpush.decode.order import DecodeOrder
from kvpush.decode.role import DecodeRole
from kvpush.decode.spans import DecodeSpans
from kvpush.errors import KvpushError
from kvpush.telemetry.names import Counter, Failure, Hist
from kvpush.telemetry.store import Telemetry
from kvpush.transport.sidechannel import ReplyFn
from kvpush.wire import protocol, vllm

#: D's own reasons for failing a request before its KV could land: P is told (``_declined``).
DECLINED = frozenset(
    {
        Failure.NO_FREE_BLOCKS,
        Failure.INCOMPATIBLE,
        Failure.DEADLINE,
        Failure.SHUTTING_DOWN,
        Failure.OVERLOADED,
        Failure.RANK_FAILED,
        Failure.HANDSHAKE_FAILED,
    }
)


class DecodeGroup:
    def __init__(self, roles: list[DecodeRole], telemetry: Telemetry | None = None) -> None:
        self.roles = roles
        self.telemetry = telemetry  # request-level counts when there is more than one rank
        self.spans = DecodeSpans.of(roles[0].ctx)  # --otlp-traces-endpoint (None: off)

    def close(self) -> None:
        """Its traces (if on) linger through the drain; each rank's role stops its threads."""
        if self.spans is not None:
            self.spans.close()

    def handle(self, req: protocol.SideRequest, reply: ReplyFn) -> bool:
        if isinstance(req, protocol.DeclineReq) and req.origin == Role.PREFILL:
            for role in self.roles:
                role.ctx.telemetry.inc(Counter.DECLINES_RECEIVED)
                with contextlib.suppress(KvpushError):  # a closed inbox: the rank is stopping
                    role.declined_by_p(req)
            reply(protocol.DeclineRep(rid=req.rid, ended=len(self.roles)))
            return True
        if not isinstance(req, protocol.DecodeReq):
            return False
        spans = self.spans
        t0 = spans.traced(req) if spans is not None else 0.0
        fut = self.submit(DecodeOrder.of(req))
        rid = req.rid
        fut.add_done_callback(lambda f: reply(msgspec.structs.replace(f.result(), rid=rid)))
        if spans is not None and t0:
            fut.add_done_callback(lambda f: spans.answered(req, t0, f.result()))
        return True

    def set_verify(self, on: bool) -> None:
        """Every rank checks its completed shares against the pattern (``on``), or not."""
        for role in self.roles:
            role.set_verify(on)

    def decode(
        self,
        transfer_id: str,
        prefill_address: str,
        num_blocks: int,
        deadline_s: float = 0.0,
        request_id: str = "",
    ) -> Future[protocol.DecodeRep]:
        """A plain kvpush request (``submit`` takes any ``DecodeOrder``); the future's
        ``DecodeRep`` says how it ended and how long it took (it never raises for a peer's
        failure)."""
        return self.submit(
            DecodeOrder(transfer_id, prefill_address, num_blocks, deadline_s, request_id)
        )

    def submit(self, order: DecodeOrder) -> Future[protocol.DecodeRep]:
        """``DecodeRole.decode`` on every rank; one answer (see the module docstring)."""
        dead = self._dead_rank(order)
        if dead is not None:
            return dead
        if len(self.roles) == 1:  # (a failed answer is declined to P by the rank itself)
            return self.roles[0].decode(
                order, on_failed=functools.partial(self._declined, order.prefill_address)
            )
        request_id = order.request_id
        if order.vllm_params is not None and not request_id:
            base = vllm.base_request_id(order.vllm_params.remote_request_id or order.transfer_id)
            request_id = f"{base}-{secrets.token_hex(4)}"
        # A digest is of the whole model page: every rank keeps its blocks after its ok answer
        # (``hold``) until the group has read them all, rank by rank within each block.
        whole = order.digest or order.vllm_params is not None
        join = TpJoin(len(self.roles), time.monotonic(), self._whole_digest if whole else None)
        share = order.for_rank(request_id, hold=whole)
        subs = [role.decode(share) for role in self.roles]
        out: Future[protocol.DecodeRep] = Future()
        lock = threading.Lock()
        for rank, f in enumerate(subs):
            f.add_done_callback(functools.partial(self._joined, join, lock, out, share, subs, rank))
        return out

    def _dead_rank(self, order: DecodeOrder) -> Future[protocol.DecodeRep] | None:
        """A failed answer at once when a rank's loop died (more than one rank: a whole
        request needs every rank); None when every rank is alive."""
        for r, role in enumerate(self.roles):
            err = role.failure()
            if err is not None and len(self.roles) > 1:
                dead: Future[protocol.DecodeRep] = Future()
                rep = protocol.DecodeRep(
                    transfer_id=order.transfer_id,
                    request_id=order.request_id,
                    outcome="failed",
                    reason=Failure.RANK_FAILED,
                    detail=f"D rank {r} failed ({type(err).__name__}: {err}): this endpoint "
                    "serves no request any more; restart it",
                )
                dead.set_result(rep)
                self._count(rep)
                return dead
        return None

    def _joined(
        self,
        join: TpJoin,
        lock: threading.Lock,
        out: Future[protocol.DecodeRep],
        share: DecodeOrder,
        subs: list[Future[protocol.DecodeRep]],
        rank: int,
        f: Future[protocol.DecodeRep],
    ) -> None:
        """Rank ``rank`` answered its share: the join decides; this acts on what it says. Only
        a share still unanswered is cancelled: one refused at once (a duplicate request id)
        must not cancel the request that holds that id on its rank."""
        with lock:
            res = join.add(rank, f.result())
            if res is not None:
                out.set_result(res)
            release = join.to_release()
            cancel = [r for r in join.to_cancel() if not subs[r].done()]
        for r, rid in release:  # the shares held for the digest (a failed rank freed its own)
            self.roles[r].release_held(rid)
        if res is None:
            return
        for r in cancel:  # the other ranks' shares cannot make a whole request any more
            self.roles[r].cancel(res.request_id or share.request_id or share.transfer_id)
        self._count(res)
        self._declined(share.prefill_address, res)

    def _whole_digest(self, request_ids: list[str]) -> str:
        """sha256 of the model's page of every block of the request, as a D at TP 1 holds it:
        region by region, block by block, each block's heads in rank order (heads outermost in
        a page, so rank r's page is the r-th slice); one rank's when the page is replicated."""
        pools = [role.ctx.pool for role in self.roles]
        ids = [p.allocator.blocks_of(rid) for p, rid in zip(pools, request_ids, strict=True)]
        if pools[0].cfg.replicated:
            return pools[0].digest(ids[0])
        h = hashlib.sha256()
        for region in range(pools[0].cfg.regions):
            rows = [p.region_rows(region, i) for p, i in zip(pools, ids, strict=True)]
            for b in range(len(ids[0])):
                for share in rows:
                    h.update(share[b].data)
        return h.hexdigest()

    def _declined(self, prefill_address: str, rep: protocol.DecodeRep) -> None:
        """A request D failed for a reason of its own (P did not fail it, nothing landed):
        tell P over its side channel, so P frees the transfer's blocks now instead of at the
        end of their lease. A request that registered also sent its Cancel notification; P
        treats the two alike."""
        decliner = self.roles[0].ctx.decliner
        if decliner is None or rep.outcome == "ok" or rep.reason not in DECLINED:
            return
        decliner.decline(
            prefill_address,
            protocol.DeclineReq(
                transfer_id=rep.transfer_id,
                request_id=rep.request_id,
                reason=rep.reason,
                detail=rep.detail,
                origin=Role.DECODE,
            ),
        )

    def _count(self, rep: protocol.DecodeRep) -> None:
        tm = self.telemetry
        if tm is None:
            return
        if rep.outcome == "ok":
            tm.inc(Counter.REQUESTS_OK)
            tm.observe(Hist.DECODE_LATENCY, rep.latency_s)
        else:
            tm.inc(Counter.REQUESTS_FAILED)


__all__ = ["DecodeGroup"]
