"""Transfers P will not write, known before anything is: declined by D, or refused by P.

D may decline a transfer over the side channel before any registration of it could be served
(``by_d``): its finished blocks are freed at once, or the moment they finish (an early cancel in
the push table), instead of being held until the lease lapses. P may refuse a prefill itself
(``by_p``): every D rank that registered is declined at once, and one that registers later is
declined when it does, so D fails the request now instead of at its deadline. Early cancels are
bounded (``MAX_EARLY_CANCELS``): past the bound a transfer waits for its lease as before.

Thread: the writer's owner thread (``PushWriter`` runs both as tasks other threads hand it).
"""

from __future__ import annotations

import time

from kvpush.prefill.context import WriterContext
from kvpush.prefill.outcomes import MAX_EARLY_CANCELS, Outcomes
from kvpush.prefill.table import CancelledEarly, PushOutcome, Registered, Waiting


class Declines:
    def __init__(self, ctx: WriterContext, out: Outcomes) -> None:
        self._ctx = ctx
        self._table = ctx.table
        self._out = out

    def by_d(self, transfer_id: str, reason: str, detail: str) -> None:
        """D cannot take ``transfer_id`` (it said so over the side channel, before any
        registration of it could be served): free its finished blocks now, or the moment they
        finish, instead of holding them until the lease lapses."""
        key = self._ctx.dialect.transfer_key(transfer_id)
        st = self._table.get(key)
        detail = f"D declined: {detail}"
        if isinstance(st, Waiting):
            self._table.pop(key)
            self._ctx.pool.allocator.release(key)
            self._ctx.report(PushOutcome(st.finished.transfer_id, False, reason, detail))
        elif (st is None or isinstance(st, Registered)) and self._table.count(
            CancelledEarly
        ) < MAX_EARLY_CANCELS:
            self._table.cancel_early(key, time.monotonic(), reason, detail)
        # Handshaking or writing: D registered, and its Cancel notification covers it.

    def by_p(self, transfer_id: str, reason: str, detail: str) -> None:
        """P refused the prefill of ``transfer_id``: every D rank that registered (or will) is
        told at once, so D fails the request now instead of at its deadline."""
        key = self._ctx.dialect.transfer_key(transfer_id)
        st = self._table.get(key)
        if isinstance(st, Registered):
            self._table.pop(key)
            for r in st.regs.values():
                self._out.decline(r, reason, detail)
        if (st is None or isinstance(st, Registered)) and self._table.count(
            CancelledEarly
        ) < MAX_EARLY_CANCELS:
            self._table.cancel_early(key, time.monotonic(), reason, detail, refused=True)
