"""Registry records for the pure and component tests of the fleet tools: ``record(...)`` is an
``EndpointRecord`` of a small kvpush endpoint (64 blocks, 2 layers, 4 KiB pages), any of its
fields given instead."""

from __future__ import annotations

from typing import Any

from kvpush.config import Role
from kvpush.fleet.record import EndpointRecord, Geometry

GEOMETRY = Geometry(
    num_blocks=64, layers=2, regions=4, block_bytes=4096, dtype="bfloat16", kv_layout="NHD"
)


def record(
    address: str = "10.0.0.1:5600", role: Role = Role.PREFILL, **fields: Any
) -> EndpointRecord:
    base: dict[str, Any] = {
        "role": role,
        "engine_id": f"{role}-{address}",
        "incarnation": "inc-1",
        "address": address,
        "host": "node-a",
        "pid": 42,
        "tp_size": 1,
        "wire": "kvpush",
        "geometry": GEOMETRY,
        "compat_hash": "h1",
        "kvpush_version": "0.1",
    }
    return EndpointRecord(**{**base, **fields})
