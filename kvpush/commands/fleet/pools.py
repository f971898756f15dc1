"""``fleet check``'s block budget: pairs that share an endpoint run only as many at a time as its
pool holds, so the check never fills a pool with its own pushes.

Owns ``Pools``: per endpoint, the blocks the check may hold there at once (``limit``: the free
blocks its record shows per rank, or the whole pool when it has no load summary yet), the blocks
its running pairs hold (``held``) and those a failed pair's push may still hold (``remnant``: a
push that failed or was cut short can leave P's blocks leased and D's allocated until their own
deadlines). ``admit`` says whether a pair may start now (``GO``), must wait for a running pair to
end (``WAIT``), or -- only when the endpoint itself shows too few free blocks for as long as a
pair's deadline, while a failed pair's push may still hold them -- is not driven:
``TooSmall`` with the words for it. A pair always may run alone at an endpoint (a full D is
then named by its own ``no_free_blocks``). A remnant is forgotten only on the endpoint's own
evidence: ``free_now`` asks it for its free blocks (``StatsReq``); an endpoint that cannot tell
(frozen, gone) does not hold its pairs back -- they fail with their own reason.

Not thread-safe: one owner (``check_fleet``'s scheduling loop on the caller's thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvpush.fleet.record import EndpointRecord

#: Seconds between two questions to one endpoint about its free blocks.
ASK_EVERY_S = 0.5

Decision = Literal["go", "wait"]
GO: Decision = "go"
WAIT: Decision = "wait"


@dataclass(frozen=True)
class TooSmall:
    """A pair the check does not drive: the pool cannot take its push now."""

    address: str
    detail: str


@dataclass
class Pool:
    """One endpoint's budget, in blocks per rank."""

    address: str
    role: str
    num_blocks: int
    limit: int
    held: int = 0
    remnant: int = 0
    remnant_since: float = 0.0
    asked_at: float = field(default=-1e9)

    def fits(self, blocks: int, with_remnant: bool = True) -> bool:
        used = self.held + (self.remnant if with_remnant else 0)
        return used == 0 or used + blocks <= self.limit


def limit_of(rec: EndpointRecord) -> int:
    """Blocks the check may hold at once at ``rec`` (per rank): the free blocks its last load
    summary shows (summed over ranks there), else its whole pool."""
    n = max(1, rec.geometry.num_blocks)
    if not rec.load.updated_at:
        return n
    return max(0, min(n, rec.load.free_blocks // max(1, rec.tp_size)))


class Pools:
    def __init__(
        self,
        records: dict[str, EndpointRecord],
        hold_s: float,
        free_now: Callable[[str], int | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``hold_s``: how long a remnant may hold pairs back (a pair's deadline);
        ``free_now(address)``: the endpoint's free blocks per rank now, None when it cannot
        tell."""
        self._pools = {
            a: Pool(a, str(r.role), max(1, r.geometry.num_blocks), limit_of(r))
            for a, r in records.items()
        }
        self._hold_s = hold_s
        self._free_now = free_now
        self._clock = clock

    def pool(self, address: str) -> Pool:
        return self._pools[address]

    def admit(self, p: str, d: str, blocks: int) -> Decision | TooSmall:
        """Whether the pair ``p -> d`` pushing ``blocks`` may start now; on ``GO`` its blocks
        are counted until ``release``."""
        pools = (self._pools[p], self._pools[d])
        for pool in pools:
            if not pool.fits(blocks, with_remnant=False):
                return WAIT  # a running pair ends soon (within its deadline)
        for pool in pools:
            if not pool.fits(blocks):
                verdict = self._remnant(pool, blocks)
                if verdict is not GO:
                    return verdict
        for pool in pools:
            pool.held += blocks
        return GO

    def _remnant(self, pool: Pool, blocks: int) -> Decision | TooSmall:
        """``pool`` fits only without a failed pair's remnant: ask the endpoint."""
        now = self._clock()
        if now - pool.asked_at < ASK_EVERY_S:
            return WAIT
        pool.asked_at = now
        free = self._free_now(pool.address)
        if free is None or free >= pool.held + blocks:
            pool.remnant = 0  # freed (its own word), or it cannot tell: the pair will say
            return GO
        if free + pool.remnant < pool.held + blocks:
            return GO  # short even were the remnant freed: not the check's doing; the pair says
        if now - pool.remnant_since < self._hold_s:
            return WAIT
        return TooSmall(
            pool.address,
            f"pool too small: a push of {blocks} blocks, {pool.role} {pool.address} shows "
            f"{free} of {pool.num_blocks} free after {now - pool.remnant_since:.0f}s "
            f"(a failed pair's push may still hold {pool.remnant})",
        )

    def release(self, p: str, d: str, blocks: int, ok: bool) -> None:
        """The pair ended; a pair that did not end ok may leave its blocks held there."""
        now = self._clock()
        for a in (p, d):
            pool = self._pools[a]
            pool.held -= blocks
            if not ok:
                pool.remnant += blocks
                pool.remnant_since = now

    def serialised(
        self, pairs: dict[str, int], blocks: dict[str, int], concurrency: int
    ) -> list[str]:
        """Notes for endpoints whose pool holds fewer of their pairs' pushes at once than the
        check would otherwise run there (``pairs``: pairs per address; ``blocks``: the largest
        push there)."""
        out = []
        for a, n in sorted(pairs.items()):
            pool, b = self._pools[a], blocks[a]
            at_once = max(1, pool.limit // max(1, b))
            want = min(n, concurrency)
            if at_once < want:
                out.append(
                    f"{pool.role} {a}: {b} blocks per push, {pool.limit} of {pool.num_blocks} "
                    f"free: {at_once} of its {n} pairs at a time (not {want})"
                )
        return out
