"""Test and measurement hooks live in ``kvpush.instruments.Instruments``, never in production.

``EndpointConfig`` has no field for any instrument, the serve commands refuse the old
``--writer`` flag, and ``kvpush.commands.common.node`` (the endpoint process of tests and the bench)
still reads the instrument keys of its JSON map into one ``Instruments``.
"""

from __future__ import annotations

import dataclasses

from kvpush.commands.common.node import build
from kvpush.config import EndpointConfig
from kvpush.instruments import NO_INSTRUMENTS, Instruments, WriterMode
from tests.conftest import run_cli


def test_endpoint_config_carries_no_instrument() -> None:
    hooks = {f.name for f in dataclasses.fields(Instruments)}
    assert hooks == {
        "handshake_reply_delay_s",
        "crash_rank_after",
        "start_delay_s",
        "writer",
        "drop_agents_after",
    }
    config = {f.name for f in dataclasses.fields(EndpointConfig)}
    assert not hooks & config
    assert not {"writer_mode"} & config


def test_node_json_keys_become_instruments() -> None:
    cfg, ins = build(
        {
            "role": "prefill",
            "pool": {"num_blocks": 8},
            "handshake_reply_delay_s": 1.5,
            "crash_rank_after": [1, 24],
            "start_delay_s": 4.0,
            "writer_mode": "blocking",
            "drop_agents_after": 8,
        }
    )
    assert cfg.role == "prefill" and cfg.pool.num_blocks == 8
    assert ins == Instruments(1.5, (1, 24), 4.0, WriterMode.BLOCKING, drop_agents_after=8)
    _, none = build({"role": "decode"})
    assert none == NO_INSTRUMENTS


def test_serve_has_no_writer_flag() -> None:
    r = run_cli("serve-prefill", "--writer", "blocking")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--writer" in r.stderr
    assert "Traceback" not in r.stderr
