"""Endpoints: ``open_endpoint(cfg)`` builds a started P or D endpoint (``kvpush.endpoint.core``)."""

from __future__ import annotations

from kvpush.config import EndpointConfig
from kvpush.decode.group import DecodeGroup
from kvpush.decode.role import DecodeRole
from kvpush.endpoint.core import Endpoint, RankFailure
from kvpush.prefill.group import PrefillGroup
from kvpush.prefill.role import PrefillRole


def open_prefill(cfg: EndpointConfig) -> Endpoint[PrefillRole, PrefillGroup]:
    return Endpoint(cfg, PrefillRole, PrefillGroup)


def open_decode(cfg: EndpointConfig) -> Endpoint[DecodeRole, DecodeGroup]:
    return Endpoint(cfg, DecodeRole, DecodeGroup)


def open_endpoint(
    cfg: EndpointConfig,
) -> Endpoint[PrefillRole, PrefillGroup] | Endpoint[DecodeRole, DecodeGroup]:
    """A started endpoint of ``cfg.role`` (``cfg.tp_size`` ranks); ``stop()`` it when done."""
    return open_prefill(cfg) if cfg.role == "prefill" else open_decode(cfg)


__all__ = ["Endpoint", "RankFailure", "open_decode", "open_endpoint", "open_prefill"]
