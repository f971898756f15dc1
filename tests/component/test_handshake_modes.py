"""The real HandshakeManager against real side-channel servers on 127.0.0.1; NIXL is the fake.

Notif-only vs full handshakes (what each loads and prepares), concurrency (a peer that never
answers does not delay a healthy one), typed failures naming the peer, geometry checks naming
each differing field, eviction and re-handshake.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from typing import Unpack

import msgspec
import numpy as np
import pytest

from kvpush.config import HandshakeMode, PoolConfig, Role, Timeouts
from kvpush.errors import (
    HandshakeError,
    IncompatiblePeerError,
    PeerUnreachableError,
    ShuttingDownError,
)
from kvpush.peers.handshakes import HandshakeManager
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import TransferError, TransferKind
from kvpush.wire.auth import Authenticator
from tests.support.fakes import (
    BlackHole,
    FakeAgent,
    StubOptions,
    StubPeer,
    closed_port,
    make_metadata,
    stub_pool,
    wait_until,
)

P_POOL = stub_pool()
NOTIF, FULL = HandshakeMode.NOTIF, HandshakeMode.FULL


class Env:
    def __init__(self, timeouts: Timeouts, token: bytes | None) -> None:
        self.agent = FakeAgent(name="p-hs#fake")
        self.tm = Telemetry(Role.PREFILL, "p-hs")
        md = make_metadata(Role.PREFILL, P_POOL, engine_id="p-hs", incarnation=uuid.uuid4().hex)
        self.hs = HandshakeManager(
            self.agent,
            md,
            Authenticator(token),
            timeouts,
            self.tm,
        )
        self.stubs: list[StubPeer] = []
        self.holes: list[BlackHole] = []

    def stub(
        self, role: Role = Role.DECODE, pool: PoolConfig | None = None, **kw: Unpack[StubOptions]
    ) -> StubPeer:
        s = StubPeer(role, pool or stub_pool(num_blocks=40), **kw)
        self.stubs.append(s)
        return s

    def hole(self) -> BlackHole:
        h = BlackHole()
        self.holes.append(h)
        return h

    def close(self) -> None:
        for s in self.stubs:
            s.stop()
        wait_until(lambda: self.hs.counts()["connecting"] == 0, 15, "handshakes to settle")
        for h in self.holes:
            h.close()
        self.hs.close()


@pytest.fixture
def make_env() -> Iterator[Callable[..., Env]]:
    envs: list[Env] = []

    def make(
        side_channel_s: float = 5.0,
        token: bytes | None = None,
    ) -> Env:
        t = Timeouts(side_channel_s=side_channel_s, handshake_s=side_channel_s)
        e = Env(t, token)
        envs.append(e)
        return e

    yield make
    for e in envs:
        e.close()


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


# ------------------------------------------------------------------ modes


def test_notif_only_loads_connection_metadata_and_prepares_no_descriptors(env: Env) -> None:
    d = env.stub()
    conn = env.hs.handshake_sync(d.key, NOTIF, 5)
    assert conn.mode == NOTIF
    assert conn.remote_dlist is None
    assert env.agent.count("prep_remote") == 0
    assert env.agent.loaded == {d.agent_name: "conn"}  # connection-only, no memory regions
    assert d.requests[0].mode == "notif"
    assert env.agent.connected == [d.agent_name]  # warmed at handshake time
    assert conn.metadata == d.metadata
    assert conn.agent_name == d.agent_name
    assert env.hs.ensure(d.key, NOTIF) is None  # connected: nothing to wait for


def test_full_prepares_one_region_major_list_of_every_block(env: Env) -> None:
    pool = stub_pool(num_blocks=40)
    d = env.stub(pool=pool)
    conn = env.hs.handshake_sync(d.key, FULL, 5)
    assert env.agent.loaded == {d.agent_name: "full"}
    (prep,) = env.agent.prepped_remote
    assert prep.name == d.agent_name and prep.mem_type == "DRAM"
    assert conn.remote_dlist is prep.dlist
    n = pool.regions * pool.num_blocks
    assert prep.descs.shape == (n, 3) and conn.remote_dlist.count == n
    bases = np.asarray(d.metadata.region_base_addrs, dtype=np.int64)
    expect = (bases[:, None] + np.arange(pool.num_blocks) * pool.block_bytes).reshape(-1)
    np.testing.assert_array_equal(prep.descs[:, 0], expect)  # row r*nb + b: block b of region r
    assert (prep.descs[:, 1] == pool.block_bytes).all()
    assert (prep.descs[:, 2] == 0).all()
    assert env.hs.ensure(d.key, NOTIF) is None  # full satisfies notif
    assert env.hs.ensure(d.key, FULL) is None


def test_notif_connection_upgrades_to_full(env: Env) -> None:
    d = env.stub()
    env.hs.handshake_sync(d.key, NOTIF, 5)
    fut = env.hs.ensure(d.key, FULL)
    assert fut is not None
    conn = fut.result(5)
    assert conn.mode == FULL and conn.remote_dlist is not None
    assert [r.mode for r in d.requests] == ["notif", "full"]
    assert env.hs.get(d.key) is conn


def test_pending_handshake_is_joined(env: Env) -> None:
    d = env.stub(hold=True)
    f1 = env.hs.ensure(d.key, NOTIF)
    f2 = env.hs.ensure(d.key, NOTIF)
    assert f1 is not None and f1 is f2
    wait_until(d.got_request.is_set)
    assert env.hs.counts()["connecting"] == 1
    (row,) = env.hs.rows()
    assert row["state"] == "connecting" and row["mode"] == "notif"
    d.release()
    assert f1.result(5).agent_name == d.agent_name
    assert len(d.requests) == 1


# ------------------------------------------------------------------ concurrency


def test_a_peer_that_never_answers_does_not_delay_a_healthy_one(
    make_env: Callable[..., Env],
) -> None:
    env = make_env(side_channel_s=3.0)
    holes = [env.hole() for _ in range(3)]
    stuck = [env.hs.ensure(h.key, FULL) for h in holes]
    healthy = env.stub()
    fut = env.hs.ensure(healthy.key, FULL)
    assert fut is not None
    conn = fut.result(10)
    assert conn.agent_name == healthy.agent_name
    # The silent peers are still waiting for their own deadline when the healthy one is done.
    assert not any(f is not None and f.done() for f in stuck)
    assert env.hs.counts() == {
        "connecting": 3,
        "connected": 1,
        "degraded": 0,
        "failed": 0,
        "down": 0,
    }
    # ... and each then fails with a typed error that names it.
    for h, f in zip(holes, stuck, strict=True):
        assert f is not None
        with pytest.raises(PeerUnreachableError, match=re.escape(h.address)):
            f.result(10)
    assert env.hs.counts() == {
        "connecting": 0,
        "connected": 1,
        "degraded": 0,
        "failed": 3,
        "down": 0,
    }
    assert env.tm.snapshot().counters["handshakes_failed"] == 3
    rows = {r["peer"]: r for r in env.hs.rows()}
    assert rows[holes[0].address]["state"] == "failed"
    assert "did not answer" in str(rows[holes[0].address]["last_error"])


def test_nobody_listening_is_unreachable(make_env: Callable[..., Env]) -> None:
    env = make_env(side_channel_s=0.5)
    port = closed_port()
    fut = env.hs.ensure(("127.0.0.1", port, 0), NOTIF)
    assert fut is not None
    with pytest.raises(PeerUnreachableError, match=f"127.0.0.1:{port}"):
        fut.result(10)
    assert env.agent.count("add_remote") == 0


# ------------------------------------------------------------------ typed failures


def _fail(env: Env, d: StubPeer, mode: HandshakeMode = FULL) -> BaseException:
    fut = env.hs.ensure(d.key, mode)
    assert fut is not None
    exc = fut.exception(10)
    assert exc is not None
    assert env.hs.get(d.key) is None
    return exc


def test_error_reply_is_a_handshake_error_naming_the_peer(env: Env) -> None:
    d = env.stub(error="not_ready")
    exc = _fail(env, d)
    assert isinstance(exc, HandshakeError)
    assert exc.peer == d.address
    assert str(exc).startswith(f"handshake with {d.address} failed: ")
    assert "stub refuses: not_ready" in exc.reason
    assert env.agent.count("add_remote") == 0


def test_incompatible_geometry_names_each_differing_field(env: Env) -> None:
    d = env.stub(pool=PoolConfig(num_blocks=40, layers=3, block_bytes=128, dtype="float16"))
    exc = _fail(env, d)
    assert isinstance(exc, IncompatiblePeerError)
    assert {f for f, _, _ in exc.differences} == {"dtype", "block_bytes", "layers", "regions"}
    diffs = {f: (lv, rv) for f, lv, rv in exc.differences}
    assert diffs["dtype"] == ("uint8", "float16")
    assert diffs["block_bytes"] == (64, 128)
    assert diffs["layers"] == (2, 3)
    assert diffs["regions"] == (4, 6)
    msg = str(exc)
    assert msg.startswith(f"{d.address} is incompatible: ")
    for part in (
        "dtype: local='uint8' remote='float16'",
        "block_bytes: local=64 remote=128",
        "layers: local=2 remote=3",
        "regions: local=4 remote=6",
    ):
        assert part in msg
    assert exc.hint == "start both endpoints with the same geometry, dtype and layout"
    assert env.agent.count("add_remote") == 0  # checked before anything is loaded


def test_other_protocol_version_named_before_strict_decoding(env: Env) -> None:
    d = env.stub()
    # A future peer whose metadata does not fit this version's schema at all.
    alien = msgspec.msgpack.encode(
        {
            "protocol_version": 2,
            "dtype": "uint8",
            "kv_layout": "NHD",
            "block_bytes": 64,
            "layers": 2,
            "regions": 4,
            "shiny_new_field": [1, 2],
        }
    )
    d.tamper = lambda rep: msgspec.structs.replace(rep, compat_hash="v2hash", metadata=alien)
    exc = _fail(env, d)
    assert isinstance(exc, IncompatiblePeerError)
    assert exc.differences == [("protocol_version", 1, 2)]


def test_hash_mismatch_without_differing_field(env: Env) -> None:
    d = env.stub(compat_hash="0" * 32)
    exc = _fail(env, d)
    assert isinstance(exc, HandshakeError)
    assert "compatibility hash differs (no field differs: bad hash)" in str(exc)


def test_metadata_with_wrong_region_count(env: Env) -> None:
    d = env.stub()
    d.metadata = msgspec.structs.replace(d.metadata, region_base_addrs=[1, 2])
    exc = _fail(env, d)
    assert isinstance(exc, HandshakeError)
    assert "wrong number of region addresses" in str(exc)
    assert env.agent.count("add_remote") == 0


def test_agent_name_differing_from_announced_is_refused_and_removed(env: Env) -> None:
    d = env.stub()
    d.tamper = lambda rep: msgspec.structs.replace(rep, agent_metadata=b"FAKE-FULL:impostor")
    exc = _fail(env, d)
    assert isinstance(exc, HandshakeError)
    assert f"NIXL agent name 'impostor' differs from the announced {d.agent_name!r}" in str(exc)
    assert env.agent.removed == ["impostor"]  # nothing left loaded
    assert env.agent.count("prep_remote") == 0


@pytest.mark.parametrize("step", ["add_remote", "prep_remote", "make_connection"])
def test_nixl_failure_during_handshake_leaves_nothing_loaded(env: Env, step: str) -> None:
    d = env.stub()
    env.agent.raise_on(step, TransferError(TransferKind.BACKEND, f"{step}: nixlBackendError"))
    exc = _fail(env, d)
    assert isinstance(exc, HandshakeError)
    assert exc.peer == d.address and f"{step}: nixlBackendError" in exc.reason
    assert env.agent.loaded == {}
    if step == "make_connection":
        assert len(env.agent.released_dlists) == 1  # the prepared list was released
    # ... and the peer can be handshaken afresh.
    assert env.hs.handshake_sync(d.key, FULL, 5).agent_name == d.agent_name


def test_authentication_failure_is_typed(make_env: Callable[..., Env]) -> None:
    env = make_env(token=b"a" * 32)
    good = env.stub(auth=Authenticator(b"a" * 32))
    assert env.hs.handshake_sync(good.key, NOTIF, 5).agent_name == good.agent_name
    bad = env.stub(auth=Authenticator(b"b" * 32))
    exc = _fail(env, bad, NOTIF)
    assert isinstance(exc, HandshakeError)
    assert "authentication tag" in str(exc)
    assert exc.hint == "both sides must use the same --auth-token-file"
    assert bad.requests == []  # the server refused it before the handler saw it


def test_closed_manager_refuses(env: Env) -> None:
    d = env.stub()
    env.hs.close()
    fut = env.hs.ensure(d.key, NOTIF)
    assert fut is not None
    with pytest.raises(ShuttingDownError):
        fut.result(1)


# ------------------------------------------------------------------ eviction


def test_rehandshake_after_evict(env: Env) -> None:
    d = env.stub()
    first = env.hs.handshake_sync(d.key, FULL, 5)
    assert env.hs.idle(0.0) == [d.key]
    conn = env.hs.evict(d.key, "test")
    assert conn is first
    assert env.hs.get(d.key) is None and env.hs.by_agent(d.agent_name) is None
    env.hs.release_conn(conn)
    env.hs.release_conn(conn)  # idempotent
    assert env.agent.released_dlists == [first.remote_dlist]
    assert env.agent.removed == [d.agent_name]
    assert env.tm.snapshot().counters["peers_evicted"] == 1

    d.new_incarnation()  # and it restarted meanwhile
    fut = env.hs.ensure(d.key, FULL)
    assert fut is not None
    second = fut.result(5)
    assert second is not first
    assert second.metadata.incarnation == d.incarnation
    assert env.agent.loaded == {d.agent_name: "full"}
    assert len(d.requests) == 2
    assert env.hs.by_agent(d.agent_name) is second
