"""Endpoints: the one front door to the engine.

``open_endpoint(cfg, instruments)`` builds a started P or D endpoint (``kvpush.endpoint.core``):
the serve commands, ``probe --handshake``, the node worker of the tests and the bench's load
generators all get theirs here. A load generator drives it with the endpoint's own verbs
(``prefill``, ``finish``, ``decode``, ``set_verify``, ``free_blocks``, ``wait_idle``,
``forget_handshake``...: ``kvpush.endpoint.load``), the groups' paths a served request takes;
tests and measurements add their hooks (``kvpush.instruments``). ``freeze_startup_heap`` is for a
process that serves one endpoint and nothing else, as ``serve-*`` does (``kvpush.runtime.heap``).
``DecodeRep`` is what a ``decode`` future holds: how the request ended and how long it took.

The bench may import this package's face and nothing below it (an import-linter ``forbidden``
contract in pyproject.toml). Runs on the caller's thread; the endpoint owns its own threads.
"""

from __future__ import annotations

from kvpush.config import EndpointConfig, Role
from kvpush.decode.group import DecodeGroup
from kvpush.decode.role import DecodeRole
from kvpush.endpoint.core import Endpoint, RankFailure
from kvpush.instruments import NO_INSTRUMENTS, Instruments
from kvpush.prefill.group import PrefillGroup
from kvpush.prefill.role import PrefillRole
from kvpush.runtime.heap import freeze_startup_heap
from kvpush.wire.protocol import DecodeRep


def open_endpoint(
    cfg: EndpointConfig, instruments: Instruments = NO_INSTRUMENTS
) -> Endpoint[PrefillRole, PrefillGroup] | Endpoint[DecodeRole, DecodeGroup]:
    """A started endpoint of ``cfg.role`` (``cfg.tp_size`` ranks), or the core's typed error with
    nothing left running; ``stop()`` it when done. ``instruments``: the hooks of tests and
    measurements (production, the serve commands: none)."""
    if cfg.role == Role.PREFILL:
        return Endpoint(cfg, PrefillRole, PrefillGroup, instruments)
    return Endpoint(cfg, DecodeRole, DecodeGroup, instruments)


__all__ = [
    "DecodeRep",
    "Endpoint",
    "RankFailure",
    "freeze_startup_heap",
    "open_endpoint",
]
