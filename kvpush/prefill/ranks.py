"""Which D ranks a PUSH_REG stands for, at one P rank. Pure, but for one bounded memory.

D registers with exactly the P ranks that write into it (VLLM_INTEROP.md section 4): P rank p of
P_tp writes D ranks ``targets(p, P_tp, D_tp)``, and a PUSH_REG from any other D rank (or from a D
whose TP neither divides nor is divided by P's) would write another rank's heads, or write
twice: it is refused. kvpush's PUSH_REG names its D rank. vLLM's does not: with P_tp >= D_tp
this P rank has one target, so the rank is known; with D_tp = k * P_tp every one of the k D
ranks sends a PUSH_REG, vLLM's D gives every rank the same block ids, and -- as vLLM's own P
does -- the first PUSH_REG of a request stands for all k ranks while the others' are absorbed
(the *fan-out*). The writer checks, when it posts, that such a PUSH_REG came from an agent of
one of those ranks.

Thread: the writer's owner thread.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from kvpush.peers.dialect import Dialect
from kvpush.peers.tp import targets
from kvpush.prefill.table import Registration

MAX_FANNED = 1 << 16  # requests the fan-out remembers (each for ttl_s at most)


@dataclass(slots=True)  # not frozen: one per PUSH_REG, and a frozen init costs 3x
class Routed:
    """Register these (one per target D rank they stand for); ``expected``: how many
    registrations the push waits for. Empty when the PUSH_REG was absorbed by a fan-out."""

    registrations: tuple[Registration, ...]
    expected: int


@dataclass(frozen=True)
class Refused:
    """No D rank of this PUSH_REG is written by this P rank."""

    d_rank: int
    d_tp: int


class RankRouter:
    def __init__(self, p_rank: int, p_tp: int, dialect: Dialect, ttl_s: float) -> None:
        self.p_rank, self.p_tp = p_rank, p_tp
        self._dialect = dialect  # which D rank a PUSH_REG names (vLLM's: none)
        self._ttl_s = ttl_s  # how long a fan-out absorbs the other ranks' PUSH_REGs
        self._fanned: OrderedDict[str, float] = OrderedDict()  # request key -> first seen

    def route(self, r: Registration, now: float) -> Routed | Refused:
        reg = r.reg
        d_tp, d_rank = max(1, reg.decode_tp_size), reg.decode_tp_rank
        p_tp = self.p_tp
        mine = targets(self.p_rank, p_tp, d_tp)
        if p_tp % d_tp and d_tp % p_tp:
            return Refused(d_rank, d_tp)
        named = self._dialect.d_rank(reg, mine)
        if named is None:
            return self._fan_out(r, mine, now)
        if named != d_rank:
            d_rank = named
            r = dataclasses.replace(r, reg=msgspec.structs.replace(reg, decode_tp_rank=d_rank))
        if d_rank >= d_tp or d_rank not in mine:
            return Refused(d_rank, d_tp)
        return Routed((r,), len(mine))

    def _fan_out(self, r: Registration, ranks: tuple[int, ...], now: float) -> Routed:
        fanned = self._fanned
        while fanned and next(iter(fanned.values())) < now - self._ttl_s:
            fanned.popitem(last=False)
        if r.key in fanned:
            return Routed((), len(ranks))
        fanned[r.key] = now
        if len(fanned) > MAX_FANNED:
            fanned.popitem(last=False)
        regs = tuple(
            dataclasses.replace(
                r, reg=msgspec.structs.replace(r.reg, decode_tp_rank=rank), any_rank=True
            )
            for rank in ranks
        )
        return Routed(regs, len(ranks))
