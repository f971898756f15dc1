"""Shared pieces of the scenarios: endpoint configs, the progress callback type, time bases."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NotRequired, TypedDict

from kvpush.config import Role

Progress = Callable[[str], None]


class Geometry(TypedDict):
    """A pool's shape as ``endpoint_cfg`` takes it (``**geo``)."""

    layers: int
    block_bytes: int


class PoolCfg(TypedDict):
    """An endpoint's pool, as ``EndpointCfg`` carries it."""

    num_blocks: int
    layers: int
    block_bytes: int
    dtype: NotRequired[str]
    kv_regions: NotRequired[str]
    kv_heads: NotRequired[int]
    device: NotRequired[str]


class AgentCfg(TypedDict):
    """An endpoint's NIXL agent settings, as ``EndpointCfg`` carries them."""

    progress_thread: bool
    busy_spin_us: NotRequired[int]
    etcd_endpoints: NotRequired[str]
    etcd_namespace: NotRequired[str]


class EndpointCfg(TypedDict):
    """What ``endpoint_cfg`` builds and a scenario may adjust before a worker's
    ``start_endpoint`` gets it (as JSON)."""

    role: Role
    pool: PoolCfg
    agent: AgentCfg
    verify: bool
    writer_mode: str
    phase_stamps: NotRequired[bool]
    timeouts: NotRequired[dict[str, float]]
    handshake_reply_delay_s: NotRequired[float]
    tp_size: NotRequired[int]
    coalesce: NotRequired[bool]


#: Lead time between scheduling an open-loop window and its start, so that every worker has
#: received its command before the first request is due.
LEAD_S = 0.4


#: P's open-loop generators finish a transfer's blocks this long before D asks for it, so that
#: D's latency measures the push (PUSH_REG -> WRITE -> completion), not P's model-stand-in
#: catching up after a scheduling hiccup.
PREFILL_AHEAD_S = 0.1


#: The first part of every open-loop window is not counted: both generators start at once and
#: their first requests meet cold paths of the bench itself (thread start, first fill).
def warmup_s(before_s: float) -> float:
    return min(0.25, before_s / 4)


def endpoint_cfg(
    role: Role,
    *,
    layers: int,
    block_bytes: int,
    num_blocks: int,
    verify: bool = True,
    writer: str = "deferred",
    progress_thread: bool = False,
    timeouts: dict[str, float] | None = None,
    reply_delay_s: float = 0.0,
) -> EndpointCfg:
    """An ``EndpointConfig`` and its ``Instruments`` as the JSON map
    ``kvpush.commands.common.node.build`` reads."""
    cfg: EndpointCfg = {
        "role": role,
        "pool": {"num_blocks": num_blocks, "layers": layers, "block_bytes": block_bytes},
        "agent": {"progress_thread": progress_thread},
        "verify": verify,
        "writer_mode": writer,
    }
    if os.environ.get("KVPUSH_BENCH_PHASE_STAMPS") == "0":
        # What the per-request phase stamps cost (BENCHMARKS.md): every endpoint without them.
        cfg["phase_stamps"] = False
    if timeouts:
        cfg["timeouts"] = timeouts
    if reply_delay_s:
        cfg["handshake_reply_delay_s"] = reply_delay_s
    return cfg


def start_at(lead_s: float = LEAD_S) -> float:
    """A wall-clock start time shared by the workers (same host, same clock)."""
    return time.time() + lead_s


def logs_dir(out_dir: Path, scenario: str) -> Path:
    d = out_dir / "logs" / f"{scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    return d
