"""Run one endpoint from a JSON config in this process: the worker used by benchmarks and tests.

Usage: ``python -m kvpush.commands.common.node CONFIG_JSON READY_FILE``. CONFIG_JSON holds
``EndpointConfig`` fields (``pool``, ``timeouts`` and ``agent`` as nested maps) and, at the same
level, the hooks of ``kvpush.instruments.Instruments`` that no serve command has
(``handshake_reply_delay_s``, ``crash_rank_after``, ``start_delay_s``, ``writer_mode``,
``drop_agents_after``: ``build`` sorts them out). Writes
READY_FILE (JSON: address, engine_id, incarnation, pid) atomically once started; SIGTERM/SIGINT
stop it gracefully (exit 0; a second signal exits at once with 130). The handlers are
``kvpush.runtime.signals.StopFlag``'s, which take no lock: a handler that set a
``threading.Event`` itself froze this worker now and then, as it froze ``serve`` (issue 16).
Operators use ``kvpush serve-prefill`` / ``serve-decode`` instead.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

from kvpush import logsafe
from kvpush.config import (
    AgentConfig,
    EndpointConfig,
    HandshakeMode,
    KvRegions,
    PoolConfig,
    Timeouts,
)
from kvpush.endpoint import open_endpoint
from kvpush.instruments import Instruments, WriterMode
from kvpush.runtime.heap import freeze_startup_heap
from kvpush.runtime.signals import StopFlag


def build(d: dict[str, Any]) -> tuple[EndpointConfig, Instruments]:
    """The endpoint's config and its instruments from one JSON map."""
    d = dict(d)
    rank, after = d.pop("crash_rank_after", (-1, 0))
    instruments = Instruments(
        handshake_reply_delay_s=float(d.pop("handshake_reply_delay_s", 0.0)),
        crash_rank_after=(int(rank), int(after)),
        start_delay_s=float(d.pop("start_delay_s", 0.0)),
        writer=WriterMode(d.pop("writer_mode", WriterMode.DEFERRED)),
        drop_agents_after=int(d.pop("drop_agents_after", 0)),
    )
    return build_config(d), instruments


def build_config(d: dict[str, Any]) -> EndpointConfig:
    d = dict(d)
    pool_d = dict(d.pop("pool", {}))
    if "kv_regions" in pool_d:
        pool_d["kv_regions"] = KvRegions(pool_d["kv_regions"])
    pool = PoolConfig(**pool_d)
    timeouts = Timeouts(**d.pop("timeouts", {}))
    agent = AgentConfig(**d.pop("agent", {}))
    if "handshake_mode" in d:
        d["handshake_mode"] = HandshakeMode(d["handshake_mode"])
    if "auth_token" in d and d["auth_token"] is not None:
        d["auth_token"] = d["auth_token"].encode()
    return EndpointConfig(pool=pool, timeouts=timeouts, agent=agent, **d)


def main() -> int:
    logging.basicConfig(
        level=os.environ.get("KVPUSH_TEST_LOG", "WARNING"),
        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    for h in logging.getLogger().handlers:
        logsafe.install(h)
    cfg, instruments = build(json.loads(sys.argv[1]))
    ready = sys.argv[2]
    ep = open_endpoint(cfg, instruments)
    freeze_startup_heap()  # as serve-* does
    stop = StopFlag().install((signal.SIGTERM, signal.SIGINT))
    tmp = ready + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "address": ep.address,
                "engine_id": cfg.engine_id,
                "incarnation": ep.incarnation,
                "pid": os.getpid(),
            },
            f,
        )
    os.replace(tmp, ready)
    while not stop.event.wait(0.2):
        if ep.failure() is not None:
            print(f"endpoint thread failed: {ep.failure()!r}", file=sys.stderr)
            ep.stop(1.0)
            return 1
    ep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
