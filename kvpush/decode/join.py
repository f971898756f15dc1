"""The join of one request's shares over D's tensor-parallel ranks: one answer from many.

Each D rank answers its share of a request (``DecodeRep``); ``TpJoin`` takes them as they come
(``add``) and decides once: ok when every rank's share is ok (sizes summed, the slowest rank's
latency, verified only when every rank verified, the whole page's digest when asked), failed at
the first share that failed, with that rank named. After a failure, ``to_cancel`` names the
ranks still out (their shares cannot make a whole request any more); ``to_release`` names the
ok shares held for a whole-page digest that nobody reads any more (and, for an ok answer, the
ones the digest has read). Pure: no threads, no I/O; the caller serialises ``add`` (the
group's lock) and acts on what it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvpush.telemetry import phases
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol

#: The whole page's sha256 from the ranks' request ids, in rank order (``DecodeGroup``).
Digest = Callable[[list[str]], str]


@dataclass(eq=False)
class TpJoin:
    n_ranks: int
    t0: float  # when the request came (its latency is counted from here)
    digest: Digest | None = None  # the ranks hold their ok shares for it (``hold``); None: none
    clock: Callable[[], float] = time.monotonic
    final: protocol.DecodeRep | None = field(default=None, init=False)
    _reps: dict[int, protocol.DecodeRep] = field(default_factory=dict, init=False)
    _held: dict[int, str] = field(default_factory=dict, init=False)  # ok shares held, by rank

    def add(self, rank: int, rep: protocol.DecodeRep) -> protocol.DecodeRep | None:
        """Rank ``rank``'s share: the request's answer when this share decides it, else None
        (more shares to come, or decided before)."""
        if not 0 <= rank < self.n_ranks or rank in self._reps:
            raise ValueError(f"rank {rank}: not a rank of {self.n_ranks}, or answered twice")
        self._reps[rank] = rep
        if self.digest is not None and rep.outcome == "ok":
            self._held[rank] = rep.request_id
        if self.final is not None:
            return None
        if rep.outcome != "ok":
            self.final = self._failed(rank, rep)
        elif len(self._reps) == self.n_ranks:
            self.final = self._ok([self._reps[r] for r in range(self.n_ranks)])
        return self.final

    def to_cancel(self) -> list[int]:
        """The ranks whose shares are still out, once the request failed (else none)."""
        if self.final is None or self.final.outcome == "ok":
            return []
        return [r for r in range(self.n_ranks) if r not in self._reps]

    def to_release(self) -> list[tuple[int, str]]:
        """(rank, request id) of the ok shares held for the digest that nobody reads any more
        (each returned once; none before the request is decided)."""
        if self.final is None:
            return []
        out = sorted(self._held.items())
        self._held.clear()
        return out

    def _failed(self, rank: int, rep: protocol.DecodeRep) -> protocol.DecodeRep:
        named = rep.detail.startswith(f"D rank {rank} ")
        return msgspec.structs.replace(
            rep,
            reason=rep.reason or Failure.RANK_FAILED,
            detail=(rep.detail if named else f"D rank {rank}: {rep.detail}")[:1000],
            latency_s=self.clock() - self.t0,
        )

    def _ok(self, reps: list[protocol.DecodeRep]) -> protocol.DecodeRep:
        unverified = any(r.verified is None for r in reps)
        return protocol.DecodeRep(
            transfer_id=reps[0].transfer_id,
            request_id=reps[0].request_id,
            outcome="ok",
            latency_s=max(r.latency_s for r in reps),
            nbytes=sum(r.nbytes for r in reps),
            verified=None if unverified else all(bool(r.verified) for r in reps),
            sha256=self.digest([r.request_id for r in reps]) if self.digest else "",
            phases=phases.merge(r.phases for r in reps),
        )
