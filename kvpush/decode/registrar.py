"""D's PUSH_REGs on their way to P, on the receiver's owner thread.

A request's registration goes out at once, as one ``PushReg`` per source P rank -- unless that
P said it takes ``PushRegs`` (``EndpointMetadata.takes_push_regs``, kvpush's wire, coalescing
on at both ends). Then it waits for the end of the owner's pass (``flush``: the receiver calls
it before it polls notifications and after its housekeeping) and goes with the other
registrations bound for the same P agent in one notification: one ``send_notif`` and one
message for P to fetch and open instead of one each (issue 30). A single registration still goes
as a plain ``PushReg``, byte for byte as before.

Nothing else changes: a request is *registered* with a rank only once its PUSH_REG was sent
(``Waiting.registered``), so a request failed or cancelled while its registration waited is
dropped here and P never hears of it (nothing to cancel, its blocks free at once); a send that
fails hands each request it carried to the receiver's failure path (re-handshake once, else
fail), exactly as a failed single send does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpush.config import Wire
from kvpush.decode.requests import RequestTable, Waiting, WaitPhase
from kvpush.peers.handshakes import PeerConn
from kvpush.runtime.context import EndpointContext
from kvpush.telemetry import phases
from kvpush.telemetry.names import Counter
from kvpush.transport.agent import TransferError
from kvpush.wire import protocol

#: The receiver's path for a PUSH_REG that could not be sent: (request, source rank, conn, error).
SendFailed = Callable[[Waiting, int, PeerConn, TransferError], None]


#: The most bytes of block ids (and per-request fields) one ``PushRegs`` carries: a quarter of
#: the default notification limit, so that a P configured with a smaller one still takes it.
BATCH_REG_BYTES = 16 * 1024


@dataclass(slots=True)  # not frozen: one per registration held, and a frozen init costs 4x
class _Held:
    w: Waiting
    source: int
    conn: PeerConn
    reg: protocol.PushReg


class Registrar:
    def __init__(
        self, ctx: EndpointContext, table: RequestTable, batch: bool, failed: SendFailed
    ) -> None:
        self._ctx = ctx
        self._table = table
        # D's side of ``--coalesce``; a D on vLLM's wire never batches (that wire has no form).
        self._batch = batch and ctx.cfg.wire is Wire.KVPUSH
        self._failed = failed
        self._held: dict[str, list[_Held]] = {}

    def register(self, w: Waiting) -> None:
        """PUSH_REG to every source P rank of ``w`` not registered with yet: now, or held for
        ``flush`` where that P takes ``PushRegs``."""
        ids = [w.block_ids.tolist()]
        # Stamped before the sends: P may match a PUSH_REG before this thread runs again.
        phases.stamp(w.req.phases, phases.PUSH_REG_SENT)
        held = False
        for s in w.ranks.sources:
            if s in w.registered:
                continue
            conn = w.ranks.conns[s]
            reg = self._push_reg(w, conn, ids)
            if self._batch and conn.metadata.takes_push_regs:
                self._held.setdefault(conn.agent_name, []).append(_Held(w, s, conn, reg))
                held = True
                continue
            try:
                self._ctx.agent.send_notif(conn.agent_name, self._ctx.codec.encode(reg))
            except TransferError as e:
                self._failed(w, s, conn, e)
                return
            self._sent(w, s)
        if not held:
            self._table.move(w, WaitPhase.REGISTERED)

    def flush(self) -> None:
        """Send every held registration, several to a P agent in one ``PushRegs``."""
        while self._held:
            held, self._held = self._held, {}
            done: list[Waiting] = []
            for agent_name, items in held.items():
                for batch in _batches(_live(items)):
                    self._send(agent_name, batch, done)
            for w in done:
                if w.phase is not WaitPhase.ENDED and w.registered.issuperset(w.ranks.sources):
                    self._table.move(w, WaitPhase.REGISTERED)

    def clear(self) -> None:
        """Drop what is held (the receiver fails those requests: P never heard of them)."""
        self._held.clear()

    def _send(self, agent_name: str, batch: list[_Held], done: list[Waiting]) -> None:
        msg: protocol.Notif = (
            batch[0].reg if len(batch) == 1 else protocol.PushRegs.of([h.reg for h in batch])
        )
        try:
            self._ctx.agent.send_notif(agent_name, self._ctx.codec.encode(msg))
        except TransferError as e:
            for h in batch:
                if h.w.phase is not WaitPhase.ENDED and h.source not in h.w.registered:
                    self._failed(h.w, h.source, h.conn, e)
            return
        # one send to one P agent: its connection is fine once, however many it carried
        self._ctx.handshakes.transport_ok(batch[0].w.ranks.key(batch[0].source))
        self._ctx.telemetry.inc(Counter.PUSH_REGS_SENT, len(batch))
        for h in batch:
            h.w.registered.add(h.source)
            done.append(h.w)

    def _sent(self, w: Waiting, s: int) -> None:
        self._ctx.handshakes.transport_ok(w.ranks.key(s))
        w.registered.add(s)
        self._ctx.telemetry.inc(Counter.PUSH_REGS_SENT)

    def _push_reg(self, w: Waiting, conn: PeerConn, ids: list[list[int]]) -> protocol.PushReg:
        md, req = self._ctx.metadata, w.req
        return protocol.PushReg(
            request_id=req.request_id,
            transfer_id=req.transfer_id,
            decode_engine_id=md.engine_id,
            decode_host=md.host,
            decode_port=md.port,
            decode_tp_size=md.tp_size,
            local_block_ids=ids,
            remote_engine_id=conn.metadata.engine_id,
            remote_host=req.p_addr[0],
            remote_port=req.p_addr[1],
            remote_tp_size=w.ranks.p_tp,
            remote_pp_size=req.p_pp_size,
            decode_incarnation=md.incarnation,
            decode_tp_rank=md.tp_rank,
            batch_done=self._ctx.cfg.coalesce,
        )


def _live(items: list[_Held]) -> list[_Held]:
    """What is still to send: not ended, not registered with that rank meanwhile (a request
    registered again after a failed send), each (request, rank) once."""
    seen: set[tuple[int, int]] = set()
    out: list[_Held] = []
    for h in items:
        k = (id(h.w), h.source)
        if h.w.phase is not WaitPhase.ENDED and h.source not in h.w.registered and k not in seen:
            seen.add(k)
            out.append(h)
    return out


def _batches(items: list[_Held]) -> list[list[_Held]]:
    """``items`` in order, cut at ``MAX_BATCH_REGS`` registrations, ``BATCH_REG_BYTES`` of
    block ids, or a registration whose shared fields differ (``protocol.shares``)."""
    out: list[list[_Held]] = []
    cur: list[_Held] = []
    size = 0
    for h in items:
        n = 5 * sum(len(g) for g in h.reg.local_block_ids) + 64  # msgpack: <= 5 bytes an id
        if cur and (
            len(cur) >= protocol.MAX_BATCH_REGS
            or size + n > BATCH_REG_BYTES
            or not protocol.shares(cur[0].reg, h.reg)
        ):
            out.append(cur)
            cur, size = [], 0
        cur.append(h)
        size += n
    if cur:
        out.append(cur)
    return out
