"""D's completer thread: verify a finished request's bytes, give its blocks back, answer it.

Verification reads every byte of the request's blocks; it runs here, on one executor thread, so
it never delays the receiver's notification polling. A request with nothing to read (no
verification, no digest) is answered on the receiver's thread instead; the ones a coalesced
WRITE ended together give their blocks back together first (``submit_many``). ``submit`` is
called by the receiver thread after it removed the request from its table; no other thread
touches those blocks. ``answered`` stamps a request's answer (``kvpush.telemetry.phases``) and
times an ok request's steps into the ``phase_*`` histograms; the failure path uses it too.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np

from kvpush.decode.requests import DRequest
from kvpush.memory.pool import KvPool
from kvpush.telemetry import phases
from kvpush.telemetry.names import Counter, Failure, Hist
from kvpush.telemetry.store import Telemetry
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class Completer:
    def __init__(self, pool: KvPool, telemetry: Telemetry, verify: bool) -> None:
        self._pool = pool
        self._tm = telemetry
        self.verify = (
            verify  # switched at run time by Endpoint.set_verify (timed load runs without it)
        )
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="completer")

    def submit(self, req: DRequest, block_ids: np.ndarray) -> None:
        """Complete ``req``, whose KV landed in ``block_ids``: on the executor when its bytes are
        to be read (verify, digest), else at once on the caller's thread -- the receiver's, which
        fails requests and answers them the same way; a thread hop per request is most of a
        small one's cost."""
        if self._reads(req):
            self._ex.submit(self.complete, req, block_ids)
        else:
            self.complete(req, block_ids)

    def submit_many(self, done: list[tuple[DRequest, np.ndarray]]) -> None:
        """``submit`` of each (a coalesced WRITE ended them together): those whose bytes are to
        be read go to the executor, in order; those answered at once give their blocks back
        together first, in one pass of the allocator (their runs joined) -- every one of them
        is free before any is answered -- then are answered in order (``_answer_ok``)."""
        at_once = [not self._reads(req) for req, _ in done]
        if sum(at_once) < 2:
            for req, block_ids in done:
                self.submit(req, block_ids)
            return
        now_reqs = [q for (q, _), now in zip(done, at_once, strict=True) if now]
        # (a held request keeps its blocks)
        self._pool.allocator.release_many([q.request_id for q in now_reqs if not q.hold])
        for (req, block_ids), now in zip(done, at_once, strict=True):
            if not now:
                self._ex.submit(self.complete, req, block_ids)
        self._answer_ok(now_reqs)

    def _answer_ok(self, reqs: list[DRequest]) -> None:
        """Answer requests with nothing to read whose blocks went back already, each as
        ``complete`` would: their counters bumped once for all and each histogram fed in one
        call, then each answered in order (every one counted before its answer is out)."""
        t = time.monotonic()
        latency: list[float] = []
        steps: dict[str, list[float]] = {}
        reps: list[protocol.DecodeRep] = []
        nbytes = 0
        for req in reqs:
            lat = t - req.t_start
            latency.append(lat)
            nbytes += req.nbytes
            stamps = answered(self._tm, req, observe=True, into=steps)
            reps.append(
                protocol.DecodeRep(
                    transfer_id=req.transfer_id,
                    request_id=req.request_id,
                    outcome="ok",
                    latency_s=lat,
                    nbytes=req.nbytes,
                    phases=stamps,
                )
            )
        tm = self._tm
        tm.inc(Counter.REQUESTS_OK, len(reqs))
        tm.inc(Counter.BYTES_RECEIVED, nbytes)
        tm.observe_many(Hist.DECODE_LATENCY, latency)
        for hist, values in steps.items():
            tm.observe_many(hist, values)
        for req, rep in zip(reqs, reps, strict=True):
            req.answer(rep)

    def _reads(self, req: DRequest) -> bool:
        """Whether completing ``req`` reads its bytes (a digest, or verification)."""
        return bool(req.digest) or (self.verify and not req.p_engine_id)

    def executor(self) -> Executor:
        """The completer's own thread, for work that must run where completions read the pool
        (``kvpush.decode.warmup``)."""
        return self._ex

    def close(self) -> None:
        self._ex.shutdown(wait=True)

    def complete(self, req: DRequest, block_ids: np.ndarray) -> None:
        """Verify, give the blocks back, resolve the future (this thread)."""
        verified: bool | None = None
        sha = ""
        try:
            if req.digest:
                sha = self._pool.digest(block_ids)
            if self.verify and not req.p_engine_id:  # (a vLLM P's bytes follow no kvpush
                verified = self._pool.verify(req.transfer_id, block_ids)  # pattern)
                phases.stamp(req.phases, phases.VERIFIED)
        except Exception:  # a verification bug must still resolve the request
            log.exception("verification of %s failed", req.request_id)
            verified = False
        finally:
            if not req.hold or verified is False:
                self._pool.allocator.release(req.request_id)
        latency = time.monotonic() - req.t_start
        ok = verified is not False
        stamps = answered(self._tm, req, observe=ok)
        reason = detail = ""
        if ok:
            self._tm.inc(Counter.REQUESTS_OK)
            self._tm.inc(Counter.BYTES_RECEIVED, req.nbytes)
            self._tm.observe(Hist.DECODE_LATENCY, latency)
        else:
            self._tm.fail(Failure.VERIFY_FAILED)
            self._tm.inc(Counter.REQUESTS_FAILED)
            reason = Failure.VERIFY_FAILED
            detail = "received bytes differ from the transfer's pattern"
            sha = ""  # a failed answer carries no digest
        rep = protocol.DecodeRep(
            transfer_id=req.transfer_id,
            request_id=req.request_id,
            outcome="ok" if ok else "failed",
            reason=reason,
            detail=detail,
            latency_s=latency,
            nbytes=req.nbytes,
            verified=verified,
            sha256=sha,
            phases=stamps,
        )
        req.answer(rep)


def answered(
    tm: Telemetry, req: DRequest, observe: bool, into: dict[str, list[float]] | None = None
) -> dict[str, float]:
    """Stamp the answer; time the steps of an ok request into the ``phase_*`` histograms (or
    add them to ``into``, by histogram, for the caller to feed in one call); the stamps the
    answer carries (empty when stamps are off)."""
    if req.phases is None:
        return {}
    phases.stamp(req.phases, phases.ANSWERED)
    if observe:
        for hist, seconds in phases.steps(req.phases, phases.D_STEPS):
            if into is None:
                tm.observe(hist, seconds)
            else:
                into.setdefault(hist, []).append(seconds)
    return req.phases
