"""Endpoints: ``open_endpoint(cfg)`` builds a started P or D endpoint (``kvpush.endpoint.core``);
tests and measurements add their hooks (``kvpush.instruments``) and drive load through
``kvpush.endpoint.facade``."""

from __future__ import annotations

from kvpush.config import EndpointConfig, Role
from kvpush.decode.group import DecodeGroup
from kvpush.decode.role import DecodeRole
from kvpush.endpoint.core import Endpoint, RankFailure
from kvpush.instruments import NO_INSTRUMENTS, Instruments
from kvpush.prefill.group import PrefillGroup
from kvpush.prefill.role import PrefillRole


def open_prefill(
    cfg: EndpointConfig, instruments: Instruments = NO_INSTRUMENTS
) -> Endpoint[PrefillRole, PrefillGroup]:
    return Endpoint(cfg, PrefillRole, PrefillGroup, instruments)


def open_decode(
    cfg: EndpointConfig, instruments: Instruments = NO_INSTRUMENTS
) -> Endpoint[DecodeRole, DecodeGroup]:
    return Endpoint(cfg, DecodeRole, DecodeGroup, instruments)


def open_endpoint(
    cfg: EndpointConfig, instruments: Instruments = NO_INSTRUMENTS
) -> Endpoint[PrefillRole, PrefillGroup] | Endpoint[DecodeRole, DecodeGroup]:
    """A started endpoint of ``cfg.role`` (``cfg.tp_size`` ranks); ``stop()`` it when done.
    ``instruments``: the hooks of tests and measurements (production: none)."""
    return (
        open_prefill(cfg, instruments)
        if cfg.role == Role.PREFILL
        else open_decode(cfg, instruments)
    )


__all__ = ["Endpoint", "RankFailure", "open_decode", "open_endpoint", "open_prefill"]
