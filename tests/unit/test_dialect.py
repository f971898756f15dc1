"""The wire dialects (``kvpush.peers.dialect``): pure, no endpoint, no socket.

What each wire decides is asked of its dialect; these pin the two answers side by side. The
metadata fetch (``Dialect.fetch``) talks over a side channel and is covered by the handshake
tests (``test_handshake_modes``, ``test_hostile``, ``tests/vllm``).
"""

from __future__ import annotations

import math
import uuid

import pytest

from kvpush.config import EndpointConfig, Role, Timeouts, VllmWireConfig, Wire
from kvpush.errors import IncompatiblePeerError
from kvpush.peers.dialect import KvpushDialect, VllmDialect, dialect_for
from kvpush.peers.vllm_peer import PeerHint, check_vllm_answer
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import Authenticator
from kvpush.wire.notifs import NotifCodec, VllmNotifCodec
from tests.support.fakes import make_metadata, stub_pool

HASH = "ab" * 32
WIRE = VllmWireConfig(compat_hash=HASH, block_size=32, attn_backend_name="CPU_ATTN")
KVPUSH = KvpushDialect(Authenticator(None))
VLLM = VllmDialect(WIRE)
T = Timeouts()


def _push_reg(request_id: str, transfer_id: str = "", d_rank: int = 0) -> protocol.PushReg:
    return protocol.PushReg(
        request_id=request_id,
        transfer_id=transfer_id,
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=5601,
        decode_tp_size=4,
        decode_tp_rank=d_rank,
        local_block_ids=[[1]],
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=5600,
    )


def test_the_config_chooses_the_dialect_and_its_codec() -> None:
    kv = dialect_for(EndpointConfig(role=Role.PREFILL), Authenticator(None))
    assert isinstance(kv, KvpushDialect) and isinstance(kv.codec, NotifCodec)
    cfg = EndpointConfig(role=Role.DECODE, wire=Wire.VLLM, vllm=WIRE, max_notif_bytes=4096)
    v = dialect_for(cfg, Authenticator(None))
    assert isinstance(v, VllmDialect) and isinstance(v.codec, VllmNotifCodec)
    assert v.codec.max_bytes == 4096
    assert (kv.wire, v.wire) == (Wire.KVPUSH, Wire.VLLM)
    assert (kv.declines, v.declines) == (True, False)
    assert (kv.kv_transfer_params, v.kv_transfer_params) == (False, True)


def test_transfer_keys_are_ids_or_vllm_base_request_ids() -> None:
    assert KVPUSH.transfer_key("req-1-0a1b2c3d") == "req-1-0a1b2c3d"
    assert VLLM.transfer_key("req-1-0a1b2c3d") == "req-1"
    assert VLLM.transfer_key("req-1") == "req-1"
    assert KVPUSH.registration_key(_push_reg("r1", "t1")) == "t1"
    assert KVPUSH.registration_key(_push_reg("r1")) == "r1"
    # vLLM's PUSH_REG has no transfer id: D's request id, whose base P's shares.
    assert VLLM.registration_key(_push_reg("req-1-deadbeef", "t1")) == "req-1"


def test_write_deadlines_by_size_or_none_on_vllm() -> None:
    assert KVPUSH.write_deadline(10.0, 1 << 20, T) == 10.0 + T.write_deadline_s(1 << 20)
    assert VLLM.write_deadline(10.0, 1 << 20, T) == math.inf


def test_a_push_reg_names_its_d_rank_only_on_kvpush_wire() -> None:
    assert KVPUSH.d_rank(_push_reg("r", d_rank=3), (2, 3)) == 3
    assert VLLM.d_rank(_push_reg("r", d_rank=0), (3,)) == 3  # the one target
    assert VLLM.d_rank(_push_reg("r", d_rank=0), (2, 3)) is None  # the fan-out


def test_a_failed_request_is_cancelled_or_held_for_ps_lease() -> None:
    assert KVPUSH.abandoned_until(100.0, T) is None
    assert VLLM.abandoned_until(100.0, T) == 100.0 + T.lease_s + T.write_base_s


def test_kvpush_answers_no_metadata_and_serves_its_own_handshake() -> None:
    md = make_metadata(Role.PREFILL, stub_pool(), engine_id="p", incarnation=uuid.uuid4().hex)
    assert KVPUSH.answer(md, b"agent") == ("kvpush:" + protocol.compat_hash(md), b"")
    assert KVPUSH.compat_hash(md) == protocol.compat_hash(md)
    assert KVPUSH.refuse_handshake(protocol.HandshakeReq(mode="full", requester="d")) is None
    rep = VLLM.refuse_handshake(protocol.HandshakeReq(rid=7, mode="full", requester="d"))
    assert rep is not None and (rep.rid, rep.code) == (7, "wrong_wire")


def test_a_vllm_answer_passes_a_vllm_peers_checks() -> None:
    """What one ``--wire vllm`` endpoint answers, another with the same geometry accepts; a
    peer with another hash refuses it before decoding anything."""
    pool = stub_pool(kv_layout="NHD")
    p = make_metadata(Role.PREFILL, pool, engine_id="p", incarnation=uuid.uuid4().hex)
    d = make_metadata(Role.DECODE, pool, engine_id="d", incarnation=uuid.uuid4().hex)
    compat, amd = VLLM.answer(p, b"nixl-agent-bytes")
    assert compat == HASH == VLLM.compat_hash(p)
    payload = vllm.HandshakePayload(compat, amd, None)
    got = check_vllm_answer("p:1", payload, d, WIRE, PeerHint("p", 1, Role.PREFILL), Role.PREFILL)
    assert got.agent_metadata == b"nixl-agent-bytes"
    assert got.metadata.region_base_addrs == p.region_base_addrs
    assert got.block_strides == [pool.block_bytes] * pool.regions
    other = VllmWireConfig(compat_hash="cd" * 32, block_size=32, attn_backend_name="CPU_ATTN")
    with pytest.raises(IncompatiblePeerError, match="compatibility hash"):
        check_vllm_answer("p:1", payload, d, other, PeerHint(), Role.PREFILL)


def test_a_stopping_endpoints_first_contact_answer() -> None:
    """Draining, it still answers what a peer loads (work it holds may need a handshake) and says
    ``stopping``; once its roles stop, its answer carries nothing to load, on either wire, and a
    vLLM-wire peer that reads it fails typed "shutting down" (a request ends ``shutting_down``,
    not ``handshake_failed``)."""
    from kvpush.endpoint.answers import get_meta_payload
    from kvpush.errors import HandshakeError, PeerShuttingDownError

    pool = stub_pool(kv_layout="NHD")
    p = make_metadata(Role.PREFILL, pool, engine_id="p", incarnation=uuid.uuid4().hex)
    d = make_metadata(Role.DECODE, pool, engine_id="d", incarnation=uuid.uuid4().hex)
    hint = PeerHint("p", 1, Role.PREFILL)
    draining = get_meta_payload(p, VLLM, False, b"agent", (0, 0), stopping=True)
    assert draining.kvpush is not None and draining.kvpush.stopping and draining.kvpush.error == ""
    assert not draining.kvpush.shut_down
    # Draining, asked for a rank it lacks: no metadata, but not "shutting down".
    unserved = get_meta_payload(p, VLLM, False, b"agent", (0, 3), stopping=True)
    assert unserved.kvpush is not None and not unserved.kvpush.shut_down
    with pytest.raises(HandshakeError, match="not served here"):
        check_vllm_answer("p:1", unserved, d, WIRE, hint, Role.PREFILL)
    assert check_vllm_answer("p:1", draining, d, WIRE, hint, Role.PREFILL).agent_metadata
    for dialect in (KVPUSH, VLLM):
        closed = get_meta_payload(p, dialect, False, b"agent", (0, 0), stopping=True, closed=True)
        assert (closed.compatibility_hash, closed.agent_metadata_bytes) == ("", b"")
        kv = closed.kvpush
        assert kv is not None and kv.stopping and kv.error == vllm.SHUT_DOWN and kv.shut_down
        assert (kv.role, kv.incarnation, kv.wire) == (Role.PREFILL, p.incarnation, dialect.wire)
    with pytest.raises(PeerShuttingDownError, match="shutting down"):
        check_vllm_answer("p:1", closed, d, WIRE, hint, Role.PREFILL)
    starting = get_meta_payload(None, VLLM, False, b"", (0, 0))
    assert starting.kvpush is not None and starting.kvpush.error == "starting"
    assert not starting.kvpush.stopping


def test_a_vllm_wire_endpoint_still_starting_is_starting_not_another_wire() -> None:
    """Its answer says only "starting" (no wire, no role yet): the handshake fails as one with a
    kvpush-wire endpoint still starting does (drive's ``starting`` sees it), not as
    ``WrongWireError`` "speaking kvpush's wire" -- which failed the request ``incompatible``."""
    from kvpush.commands.common.reasons import starting
    from kvpush.endpoint.answers import get_meta_payload
    from kvpush.errors import HandshakeError

    d = make_metadata(Role.DECODE, stub_pool(), engine_id="d", incarnation=uuid.uuid4().hex)
    payload = get_meta_payload(None, VLLM, False, b"", (0, 0))
    with pytest.raises(HandshakeError) as ei:
        check_vllm_answer("p:1", payload, d, WIRE, PeerHint("p", 1, Role.PREFILL), Role.PREFILL)
    assert type(ei.value) is HandshakeError and starting(ei.value), ei.value.message
