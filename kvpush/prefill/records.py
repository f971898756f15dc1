"""The records P's push table is made of and reports: what arrives, what is matched, how it ended.

``Finished`` (P's blocks of a transfer are ready) and ``Registration`` (D's PUSH_REG, from one D
rank) arrive; a ``Push`` is the two matched, with one registration per target D rank; a
``PushOutcome`` says how a push ended, to whoever waits for it. ``reg_key`` is the table key a
PUSH_REG names. Pure data, all frozen: a ``Finished`` is made on the thread that finished the
blocks (``kvpush.prefill.role``), the others on the writer's owner thread; any thread reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpush.peers.handshakes import PeerKey
from kvpush.wire import protocol


@dataclass(slots=True)  # not frozen: built per push, and a frozen init costs 4x
class Finished:
    """P's blocks of one transfer are filled and ready to be written."""

    key: str
    transfer_id: str
    request_id: str
    block_ids: np.ndarray
    t_finished: float  # monotonic


@dataclass(slots=True)  # not frozen: built per push, and a frozen init costs 4x
class Registration:
    """D's PUSH_REG: where P must write, and who sent it."""

    key: str
    reg: protocol.PushReg
    sender: str  # NIXL agent name the PUSH_REG came from
    t_arrived: float
    # vLLM's wire at D_tp > P_tp: one PUSH_REG stands for every target D rank (the writer's
    # _fan_out), so its sender may be the agent of any of them.
    any_rank: bool = False

    @property
    def peer(self) -> PeerKey:
        """The D rank that registered: its side-channel address and TP rank."""
        reg = self.reg
        return (reg.decode_host, reg.decode_port, reg.decode_tp_rank)


@dataclass(slots=True)  # not frozen: built per push, and a frozen init costs 4x
class Push:
    """P's blocks matched with every registration they are written to: one per target D rank
    (more than one when D has more ranks than P: each gets its chunk of P's page)."""

    finished: Finished
    registrations: tuple[Registration, ...]
    attempt: int = 0

    @property
    def key(self) -> str:
        return self.finished.key

    @property
    def registration(self) -> Registration:
        return self.registrations[0]

    @property
    def peer(self) -> PeerKey:
        return self.registration.peer

    def retry(self) -> Push:
        return Push(self.finished, self.registrations, self.attempt + 1)


def reg_key(reg: protocol.PushReg) -> str:
    return reg.transfer_id or reg.request_id


@dataclass(slots=True)  # not frozen: built per push, and a frozen init costs 4x
class PushOutcome:
    """How the push of one transfer ended (reported to whoever waits for it)."""

    transfer_id: str
    ok: bool
    reason: str = ""
    detail: str = ""
    nbytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # kvpush.telemetry.phases, wall clock
    peer: PeerKey | None = None  # the D (rank) it was written to, once matched (for its trace)
