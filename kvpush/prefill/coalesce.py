"""Coalescing: the legs ready for one D rank in one writer pass, posted as one WRITE.

When P's writer matches several pushes for the same D rank (the same connection) in one pass,
their legs wait here until the pass ends (``Legs.flush``), then go as one NIXL WRITE -- the
descriptor index pairs of them all, by local index (``indices``) -- with one ``Completions``
notification naming every request. Nothing ever waits to fill a batch: a pass batches only
what is ready in it, and the writer flushes before anything that could see those pushes (a
task, a cancel, housekeeping, a peer's eviction). A leg is coalesced only on kvpush's wire
(``--coalesce``, the default) and only for a D whose PUSH_REG said it takes ``Completions``
(``PushReg.batch_done``); every other leg is posted at once, alone, as before. A group of one
goes alone too, with its own ``Completion``: what a D sees then is byte for byte what it saw
before coalescing existed.

This module holds what is pure: the pending groups, their caps (members, bytes, the
notification's size) and the batch's indices and notification. Posting, polling and ending a
batch is ``kvpush.prefill.legs``. Thread: the writer's owner thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpush.config import EndpointConfig
from kvpush.memory.descriptors import Indices
from kvpush.peers.handshakes import PeerConn
from kvpush.prefill.plan import WritePlan
from kvpush.prefill.table import Registration, Writing
from kvpush.transport.agent import DList
from kvpush.wire import protocol

#: The most legs one WRITE carries (``Completions`` may name up to ``MAX_BATCH_DONE``). 16, not
#: 64: with 64 a window of 64 small pushes went as one WRITE, and P and D took turns on it (D
#: handled a convoy of 64 while P's writer waited for the next registrations); in batches of 16,
#: P posts the next batch while D handles the last: 1-block pushes at 64 in flight +17-25 % (8 or
#: 12 alike, 4 lost it again to the per-WRITE cost; BENCHMARKS.md, "Batches of 8 MiB and of 16
#: pushes").
MAX_MEMBERS = 16
#: A leg larger than this is never coalesced, and a batch stops growing here: large pushes run
#: at the copy's speed alone, and a batch's first request waits for at most this many of the
#: others' bytes (~1.5 ms of copying at 6 GB/s). 8 MiB, not 4: 2 MiB requests then share a WRITE
#: four at a time, not two, which took 256 KiB-block pushes from 82-88 % to 93-98 % of raw NIXL
#: in an A/B (BENCHMARKS.md, "Batches of 8 MiB and of 16 pushes"); 16 MiB swallowed bench
#: bandwidth's whole window of 8 and lost the pipelining (83 %).
MAX_BATCH_BYTES = 8 << 20
#: Room for the notification's request and transfer ids (UTF-8: at most 4 bytes a character),
#: well under the notification limit once enveloped and sealed.
_NOTIF_BUDGET = protocol.MAX_NOTIF_BYTES // 2


@dataclass(slots=True)  # not frozen: one per push, and a frozen init costs 4x
class Ready:
    """One leg matched in this pass, waiting for the pass's end to be posted."""

    writing: Writing
    registration: Registration
    conn: PeerConn
    plan: WritePlan
    local: DList


def coalescable(cfg: EndpointConfig, r: Registration, plan: WritePlan) -> bool:
    """Whether this leg may wait for the pass's end to share a WRITE."""
    return cfg.coalesce and r.reg.batch_done and plan.nbytes <= MAX_BATCH_BYTES


class Pending:
    """The legs ready in this pass, by connection (the object: a new incarnation of a peer is
    another group), in the order they were matched."""

    def __init__(self) -> None:
        self._groups: dict[int, list[Ready]] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def add(self, leg: Ready) -> None:
        g = self._groups.get(id(leg.conn))
        if g is None:
            self._groups[id(leg.conn)] = [leg]
        else:
            g.append(leg)

    def take(self) -> list[list[Ready]]:
        """Every pending leg, as the WRITEs to post: each connection's legs in order, cut
        where a cap (members, bytes, the notification's size) would be passed."""
        groups, self._groups = self._groups, {}
        out: list[list[Ready]] = []
        for legs in groups.values():
            cur: list[Ready] = []
            nbytes = ids = 0
            for leg in legs:
                reg = leg.registration.reg
                size = 4 * (len(reg.request_id) + len(reg.transfer_id)) + 16
                if cur and (
                    len(cur) >= MAX_MEMBERS
                    or nbytes + leg.plan.nbytes > MAX_BATCH_BYTES
                    or ids + size > _NOTIF_BUDGET
                ):
                    out.append(cur)
                    cur, nbytes, ids = [], 0, 0
                cur.append(leg)
                nbytes += leg.plan.nbytes
                ids += size
            out.append(cur)
        return out


def indices(group: list[Ready]) -> tuple[Indices, Indices, int]:
    """The batch's local and remote descriptor indices and its bytes: every leg's (local,
    remote) pairs, ordered by local index.

    Each pair is one copy and a WRITE's copies have no order of their own (D hears of the
    batch only once all of them landed), so the order is free -- and in this one NIXL's
    ``make_prepped_xfer`` merges pairs whose local and remote blocks both follow on into one
    descriptor. Legs concatenated as matched interleave their regions (leg 1's K, leg 1's V,
    leg 2's K, ...), which nothing can merge; ordered, 16 one-block pushes whose blocks follow
    on at both ends are 2 descriptors, not 32 (BENCHMARKS.md, issue 30)."""
    plans = [g.plan for g in group]
    nbytes = sum(p.nbytes for p in plans)
    lidx: list[int] = []
    ridx: list[int] = []
    for p in plans:
        if not isinstance(p.local_idx, list) or not isinstance(p.remote_idx, list):
            la = np.concatenate([np.asarray(q.local_idx, dtype=np.int32) for q in plans])
            ra = np.concatenate([np.asarray(q.remote_idx, dtype=np.int32) for q in plans])
            order = np.argsort(la, kind="stable")
            return la[order], ra[order], nbytes
        lidx += p.local_idx
        ridx += p.remote_idx
    pairs = sorted(zip(lidx, ridx, strict=True))
    return [a for a, _ in pairs], [b for _, b in pairs], nbytes


def notification(cfg: EndpointConfig, group: list[Ready]) -> protocol.Completions:
    """The one notification of a batch: each member's request, as its ``Completion`` says it."""
    return protocol.Completions(
        p_tp_size=cfg.tp_size,
        p_tp_rank=cfg.tp_rank,
        done=[
            protocol.Done(
                request_id=g.registration.reg.request_id,
                transfer_id=g.registration.reg.transfer_id,
                nbytes=g.plan.nbytes,
            )
            for g in group
        ],
    )
