"""The NIXL agent's words at the seam: ``XferState`` and ``TransferKind`` from a real agent.

Two real NIXL agents in this process (UCX over DRAM) write to each other: the adapter answers
with ``XferState`` members and raises ``TransferError`` with ``TransferKind`` members, whose values
are the strings they replaced (logs and JSON read the same as before the enums).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvpush.config import AgentConfig
from kvpush.memory.descriptors import block_descs
from kvpush.transport.agent import GONE, Agent, TransferError, TransferKind, Xfer, XferState
from kvpush.transport.nixl import NixlAgent, _translate
from tests.support.fakes import FakeAgent, as_agent, fake_agent_md

BLOCKS, BLOCK_BYTES = 4, 4096


class _Side:
    def __init__(self, role: str) -> None:
        self.agent = NixlAgent(f"{role}-{uuid.uuid4().hex[:8]}", AgentConfig())
        self.kv = torch.zeros(BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
        self.agent.register(self.kv)
        self.descs = block_descs([self.kv.data_ptr()], BLOCKS, BLOCK_BYTES, 0)


@pytest.fixture
def pair() -> Iterator[tuple[_Side, _Side]]:
    a, b = _Side("a"), _Side("b")
    try:
        yield a, b
    finally:
        a.agent.close()
        b.agent.close()


def _until_done(agent: Agent, x: Xfer, st: XferState, target: Agent) -> XferState:
    """Poll ``x`` until it is no longer in progress (the target's agent progressed meanwhile,
    as D's owner thread does by polling its notifications)."""
    deadline = time.monotonic() + 10.0
    while st is XferState.PROC and time.monotonic() < deadline:
        target.get_notifs()
        time.sleep(0.001)
        st = agent.state(x)
    return st


def test_a_real_write_reports_xfer_states(pair: tuple[_Side, _Side]) -> None:
    a, b = pair
    a.kv[BLOCK_BYTES : 2 * BLOCK_BYTES] = torch.arange(BLOCK_BYTES, dtype=torch.int64) % 251
    name = a.agent.add_remote(b.agent.metadata_full())
    assert name == b.agent.name
    local = a.agent.prep_local(a.descs, "DRAM")
    remote = a.agent.prep_remote(name, b.descs, "DRAM")
    try:
        x, st = a.agent.post_write(local, [1], remote, [3], b"note")
        assert isinstance(st, XferState)
        st = _until_done(a.agent, x, st, b.agent)
        assert st is XferState.DONE and st == "DONE"
        assert json.dumps({"state": st}) == '{"state": "DONE"}'
        assert a.agent.release(x)
        assert torch.equal(b.kv[3 * BLOCK_BYTES :], a.kv[BLOCK_BYTES : 2 * BLOCK_BYTES])
    finally:
        a.agent.release_dlist(local)
        a.agent.release_dlist(remote)


def test_a_removed_agent_is_refused_as_peer_unknown(pair: tuple[_Side, _Side]) -> None:
    a, b = pair
    name = a.agent.add_remote(b.agent.metadata_full())
    a.agent.remove_remote(name)
    with pytest.raises(TransferError) as ei:
        a.agent.send_notif(name, b"late")
    assert ei.value.kind is TransferKind.PEER_UNKNOWN
    assert json.dumps(ei.value.kind) == '"peer_unknown"'
    assert ei.value.kind in GONE
    assert ei.value.status == "stale_agent"
    assert a.agent.stale_agent_uses == 1


def test_bytes_that_are_not_agent_metadata_are_bad_metadata(pair: tuple[_Side, _Side]) -> None:
    a, _ = pair
    with pytest.raises(TransferError) as ei:
        a.agent.add_remote(b"not NIXL metadata")
    assert ei.value.kind is TransferKind.BAD_METADATA and f"{ei.value.kind}" == "bad_metadata"


@pytest.mark.parametrize(
    ("exc_name", "kind", "status"),
    [
        ("nixlRemoteDisconnectError", TransferKind.PEER_DEAD, "NIXL_ERR_REMOTE_DISCONNECT"),
        ("nixlNotFoundError", TransferKind.PEER_UNKNOWN, "NIXL_ERR_NOT_FOUND"),
        ("nixlBackendError", TransferKind.BACKEND, "NIXL_ERR_BACKEND"),
        ("nixlCancelledError", TransferKind.CANCELLED, "NIXL_ERR_CANCELED"),
        ("SomethingElse", TransferKind.NIXL_ERROR, "NIXL_ERR_UNKNOWN"),
    ],
)
def test_nixl_exceptions_translate_to_kinds(exc_name: str, kind: TransferKind, status: str) -> None:
    exc = type(exc_name, (Exception,), {})("boom")
    err = _translate(exc, "transfer")
    assert (err.kind, err.status) == (kind, status)
    assert str(err) == f"transfer: {exc_name}: boom"


def test_the_fake_speaks_the_same_states() -> None:
    fake = FakeAgent()
    agent = as_agent(fake)
    dl = agent.prep_local(np.zeros((1, 3), dtype=np.int64), "DRAM")
    x, st = agent.post_write(dl, [0], dl, [0], b"")
    assert st is XferState.PROC
    fake.script_states(x, XferState.ERR)
    assert agent.state(x) is XferState.ERR
    assert agent.state(x) is XferState.DONE  # then the default


def test_the_fake_fetches_only_published_agents_and_drops_under() -> None:
    fake = FakeAgent()
    with pytest.raises(TransferError) as ei:
        fake.fetch_remote("d#1", 0.1)
    assert ei.value.kind is TransferKind.PEER_UNKNOWN
    fake.published["d#1"] = fake_agent_md("d#1", full=True)
    assert fake.fetch_remote("d#1", 0.1) == "d#1"
    assert fake.loaded == {"d#1": "full"}
    fake.drop_remote_under("d#1")
    assert fake.loaded == {} and fake.dropped_under == ["d#1"]
    assert fake.removed == []  # the adapter's own account is not a removal
