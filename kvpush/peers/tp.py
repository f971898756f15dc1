"""Tensor-parallel push mapping: which P rank writes which bytes into which D rank. Pure.

The model's KV heads are split evenly over a side's ranks, heads outermost in a page, so a
rank's page is a contiguous slice of the model's page (``kvpush.config.PoolConfig``); a single
head (an MLA latent) is replicated on every rank. With P at ``p_tp`` ranks and D at ``d_tp``
(vLLM's rules, VLLM_INTEROP.md section 4):

============================  ==================================  ===========================
case                          P rank p writes                     completions per D rank
============================  ==================================  ===========================
p_tp == d_tp                  its page -> D rank p                1
p_tp == k * d_tp              its page -> D rank p // k, at       k (each P rank of the group)
                              offset (p % k) * P_len in D's page
d_tp == k * p_tp              chunk i of its page (D_len bytes)   1
                              -> D rank p * k + i
replicated, d_tp == k * p_tp  its whole page -> D ranks p*k + i   1
replicated, p_tp == k * d_tp  its whole page -> D rank p // k     k (the same bytes k times)
============================  ==================================  ===========================

Sizes that neither divide nor are divided are refused, naming both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvpush.address import format_address
from kvpush.errors import IncompatiblePeerError


def check_ratio(p_tp: int, d_tp: int, peer: str | tuple[str, int]) -> None:
    """Refuse sizes that neither divide nor are divided (``peer``: a name, or an address
    formatted only then -- D checks each request's P)."""
    if p_tp % d_tp and d_tp % p_tp:
        name = peer if isinstance(peer, str) else format_address(*peer)
        raise IncompatiblePeerError(
            f"{name}: tensor-parallel sizes do not fit: P has {p_tp} ranks, D has {d_tp}; "
            "one must divide the other",
            [("tp_size", p_tp, d_tp)],
            "run P and D at TP sizes that divide one another (e.g. 8 and 4)",
        )


#: TP sizes up to this have their rank maps cached (D asks for each request's sources, P for
#: each PUSH_REG's targets); a larger one -- no deployment's, a hostile peer's -- is mapped
#: afresh each time, so that a peer cycling through sizes cannot fill memory with them.
CACHED_TP = 256


def sources(d_rank: int, d_tp: int, p_tp: int) -> tuple[int, ...]:
    """The P ranks that write into D rank ``d_rank`` (D registers with exactly these)."""
    return _facing(d_rank, d_tp, p_tp)


def targets(p_rank: int, p_tp: int, d_tp: int) -> tuple[int, ...]:
    """The D ranks P rank ``p_rank`` writes into (it gets a PUSH_REG from each)."""
    return _facing(p_rank, p_tp, d_tp)


def _facing(rank: int, mine: int, theirs: int) -> tuple[int, ...]:
    """The ranks of the other side (``theirs`` ranks) that rank ``rank`` of ``mine`` pairs
    with: the same map either way round, so sources and targets are one function."""
    if mine <= CACHED_TP and theirs <= CACHED_TP:
        return _facing_cached(rank, mine, theirs)
    return _facing_cached.__wrapped__(rank, mine, theirs)


@functools.lru_cache(maxsize=128)
def _facing_cached(rank: int, mine: int, theirs: int) -> tuple[int, ...]:
    if theirs >= mine:
        k = theirs // mine
        return tuple(rank * k + i for i in range(k))
    return (rank // (mine // theirs),)


@dataclass(frozen=True)
class Slice:
    """Bytes of one page a WRITE moves: ``length`` bytes from ``local_offset`` in P's page to
    ``remote_offset`` in D's page, in every region."""

    local_offset: int
    remote_offset: int
    length: int


def write_slice(
    p_rank: int, d_rank: int, p_tp: int, d_tp: int, p_len: int, d_len: int, replicated: bool
) -> Slice:
    """What P rank ``p_rank`` writes into D rank ``d_rank`` of every block (``p_len``, ``d_len``:
    the two sides' page lengths of one region)."""
    if d_rank not in targets(p_rank, p_tp, d_tp):
        raise ValueError(f"P rank {p_rank} of {p_tp} does not write D rank {d_rank} of {d_tp}")
    if replicated or p_tp == d_tp:
        if p_len != d_len:
            why = "one KV head, replicated on every rank" if replicated else "the same TP"
            raise ValueError(
                f"whole pages are written ({why}), but P's is {p_len} bytes and D's {d_len}"
            )
        return Slice(0, 0, p_len)
    if p_tp > d_tp:
        k = p_tp // d_tp
        if d_len != k * p_len:
            raise ValueError(f"D's page of {d_len} bytes is not {k} of P's {p_len}")
        return Slice(0, (p_rank % k) * p_len, p_len)
    k = d_tp // p_tp
    if p_len != k * d_len:
        raise ValueError(f"P's page of {p_len} bytes is not {k} of D's {d_len}")
    return Slice((d_rank % k) * d_len, 0, d_len)
