"""What P's writer and its collaborators share: one frozen context, built once per rank.

``PushWriter`` builds a ``WriterContext`` from the rank's ``EndpointContext`` (``of``), uses it
itself and hands it to ``Outcomes``, ``Fences`` and ``Legs`` instead of each taking the same long
list of collaborators. Collaborators never call
back up into the writer: what the writer must act on comes back as an event
(``kvpush.prefill.events``). ``report`` is the outward sink of push outcomes (the role's
watches), not a way back into the writer.

Built on the thread that makes the writer; read only by the writer's owner thread after that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpush.config import EndpointConfig
from kvpush.instruments import Instruments
from kvpush.memory.pool import KvPool
from kvpush.peers.dialect import Dialect
from kvpush.peers.handshakes import HandshakeManager
from kvpush.prefill.plan import LocalGeometry
from kvpush.prefill.table import PushOutcome, PushTable
from kvpush.runtime.context import EndpointContext
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import Agent
from kvpush.wire.notifs import Codec


@dataclass(frozen=True)
class WriterContext:
    """The collaborators of one P rank's writer (all owned elsewhere; shared, never replaced)."""

    cfg: EndpointConfig
    agent: Agent
    pool: KvPool
    table: PushTable
    handshakes: HandshakeManager
    codec: Codec
    telemetry: Telemetry
    geom: LocalGeometry
    report: Callable[[PushOutcome], None]  # how each push ended, to whoever waits for it
    dialect: Dialect  # what differs between the wires (keys, WRITE deadlines)
    instruments: Instruments  # the hooks of tests and measurements (production: none)

    @classmethod
    def of(
        cls, ep: EndpointContext, table: PushTable, report: Callable[[PushOutcome], None]
    ) -> WriterContext:
        """The writer's share of its rank's context, with the writer's table and outcome sink."""
        pc = ep.pool.cfg
        geom = LocalGeometry(pc.num_blocks, pc.regions, pc.block_bytes)
        return cls(
            ep.cfg,
            ep.agent,
            ep.pool,
            table,
            ep.handshakes,
            ep.codec,
            ep.telemetry,
            geom,
            report,
            ep.dialect,
            ep.instruments,
        )
