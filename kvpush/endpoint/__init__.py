"""Endpoints: ``open_endpoint(cfg)`` builds a started P or D endpoint (``kvpush.endpoint.core``)."""

from __future__ import annotations

from typing import Any

from kvpush.config import EndpointConfig
from kvpush.decode.role import DecodeRole
from kvpush.endpoint.core import Endpoint
from kvpush.prefill.role import PrefillRole


def open_prefill(cfg: EndpointConfig) -> Endpoint[PrefillRole]:
    return Endpoint(cfg, PrefillRole)


def open_decode(cfg: EndpointConfig) -> Endpoint[DecodeRole]:
    return Endpoint(cfg, DecodeRole)


def open_endpoint(cfg: EndpointConfig) -> Endpoint[Any]:
    """A started endpoint of ``cfg.role``; ``stop()`` it when done."""
    return open_prefill(cfg) if cfg.role == "prefill" else open_decode(cfg)


__all__ = ["Endpoint", "open_decode", "open_endpoint", "open_prefill"]
