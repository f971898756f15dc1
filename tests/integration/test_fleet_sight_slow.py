"""A listed endpoint that is slow to answer is seen, not unseen (``kvpush.commands.fleet.sight``).

On a loaded host a live side channel can miss fleet's contact deadline (3 s): the vLLM fleet test
once found none of four listed endpoints within it on CI, and with two busy loops beside its three
vLLM engines two of four missed it here. A contact that times out at a side channel that is there
is asked once more with three times the deadline. Real endpoint in this process (real NIXL, real
ZMQ), whose handshake answers come late (``Instruments.handshake_reply_delay_s``).
"""

from __future__ import annotations

import pytest

from kvpush.commands.fleet.entries import Entry
from kvpush.commands.fleet.sight import sight
from kvpush.config import EndpointConfig, PoolConfig, Role
from kvpush.endpoint import open_endpoint
from kvpush.instruments import Instruments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_a_listed_endpoint_slower_than_the_contact_deadline_is_seen() -> None:
    cfg = EndpointConfig(
        role=Role.DECODE, pool=PoolConfig(num_blocks=16, layers=1, block_bytes=4096)
    )
    ep = open_endpoint(cfg, Instruments(handshake_reply_delay_s=1.5))
    try:
        seen = sight(Entry(ep.address), None, timeout_s=1.0)
        assert seen.record is not None, seen.problem
        assert (seen.kind, seen.record.incarnation) == ("kvpush", ep.incarnation)
        # Slower than both tries: named, with both tries said.
        late = sight(Entry(ep.address), None, timeout_s=0.3)
        assert late.record is None and late.kind == "error", late
        assert "did not answer within 0.9s (asked twice)" in late.problem, late.problem
    finally:
        ep.stop()
