"""Unit tests of coalescing's pure parts (issue 30): the ``Completions`` notification on kvpush's
wire (and its absence from vLLM's), ``PushReg.batch_done`` from older peers, and how P's writer
groups and cuts the legs ready in one pass (``kvpush.prefill.coalesce``)."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from kvpush.config import EndpointConfig, HandshakeMode, Role
from kvpush.errors import ProtocolError
from kvpush.peers.state import PeerConn
from kvpush.prefill import coalesce
from kvpush.prefill.coalesce import MAX_BATCH_BYTES, MAX_MEMBERS, Pending, Ready
from kvpush.prefill.plan import WritePlan
from kvpush.prefill.table import Finished, Push, Registration, Writing
from kvpush.transport.agent import DList
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import Authenticator
from kvpush.wire.fields import Groups, NonNeg, Port, Str128, Str256
from kvpush.wire.notifs import NotifCodec
from tests.support.fakes import FakeHandle, make_metadata, stub_pool

TOKEN = b"0123456789abcdef0123"


def _reg(rid: str, *, batch_done: bool = True, tid: str = "") -> protocol.PushReg:
    return protocol.PushReg(
        request_id=rid,
        transfer_id=tid or rid,
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=7000,
        local_block_ids=[[1, 2]],
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=7001,
        batch_done=batch_done,
    )


# ------------------------------------------------------------------ the wire


@pytest.mark.parametrize("token", [None, TOKEN])
def test_completions_round_trip_sealed_or_not(token: bytes | None) -> None:
    codec = NotifCodec(Authenticator(token))
    msg = protocol.Completions(
        p_tp_size=2,
        p_tp_rank=1,
        done=[protocol.Done(request_id=f"r{i}", transfer_id=f"t{i}", nbytes=i) for i in range(5)],
    )
    assert codec.decode(codec.encode(msg)) == msg


def test_completions_naming_nothing_or_too_many_is_refused() -> None:
    codec = NotifCodec(Authenticator(None))

    def framed(n: int) -> bytes:
        body = protocol.encode({"type": "done_n", "done": [["r", "t", 0]] * n})
        return protocol.MAGIC_NOTIF + protocol.make_envelope_bytes(body)

    ok = codec.decode(framed(protocol.MAX_BATCH_DONE))  # the same framing, within bounds
    assert isinstance(ok, protocol.Completions) and len(ok.done) == protocol.MAX_BATCH_DONE
    for n in (0, protocol.MAX_BATCH_DONE + 1):
        with pytest.raises(ProtocolError):
            codec.decode(framed(n))


class _OldPushReg(msgspec.Struct, tag="push_reg", frozen=True, kw_only=True):
    """PushReg as a kvpush D before issue 30 sent it: no ``batch_done``."""

    request_id: Str256
    transfer_id: Str256 = ""
    decode_engine_id: Str128
    decode_host: Str256
    decode_port: Port
    decode_tp_size: int = 1
    local_block_ids: Groups
    remote_engine_id: Str128
    remote_host: Str256
    remote_port: Port
    remote_tp_size: int = 1
    remote_pp_size: int = 1
    decode_incarnation: Str128 = ""
    decode_tp_rank: NonNeg = 0


def test_an_older_d_push_reg_does_not_take_completions() -> None:
    old = _OldPushReg(
        request_id="r",
        decode_engine_id="d",
        decode_host="h",
        decode_port=1,
        local_block_ids=[[1]],
        remote_engine_id="p",
        remote_host="h",
        remote_port=2,
    )
    data = protocol.MAGIC_NOTIF + protocol.make_envelope_bytes(protocol.encode(old))
    got = NotifCodec(Authenticator(None)).decode(data)
    assert isinstance(got, protocol.PushReg) and got.batch_done is False
    # And vLLM's form, on kvpush's wire (no token) or its own: never.
    vform = vllm.encode_push_reg(_reg("r"))
    assert NotifCodec(Authenticator(None)).decode(vform).batch_done is False  # type: ignore[union-attr]


def test_vllm_form_of_push_reg_is_unchanged_by_batch_done() -> None:
    assert vllm.encode_push_reg(_reg("r", batch_done=True)) == vllm.encode_push_reg(
        _reg("r", batch_done=False)
    )


# ------------------------------------------------------------------ grouping


def _conn(port: int) -> PeerConn:
    md = make_metadata(Role.DECODE, stub_pool(), engine_id="d", incarnation="i" * 16)
    return PeerConn(
        key=("127.0.0.1", port, 0),
        metadata=md,
        agent_name=f"d{port}",
        mode=HandshakeMode.FULL,
        remote_dlist=None,
        timings={},
        rtt_s=0.0,
        clock_offset_s=0.0,
    )


_LOCAL = DList(FakeHandle("dlist"), 64)


def _ready(
    conn: PeerConn, rid: str, nbytes: int = 1024, idx: object = None, ridx: object = None
) -> Ready:
    reg = Registration(rid, _reg(rid), conn.agent_name, time.monotonic())
    f = Finished(rid, rid, rid, np.array([1]), time.monotonic())
    lidx = [1, 2] if idx is None else idx
    plan = WritePlan(
        local_idx=lidx,  # type: ignore[arg-type]
        remote_idx=lidx if ridx is None else ridx,  # type: ignore[arg-type]
        nbytes=nbytes,
    )
    return Ready(Writing(Push(f, (reg,))), reg, conn, plan, _LOCAL)


def _names(groups: list[list[Ready]]) -> list[list[str]]:
    return [[g.registration.reg.request_id for g in grp] for grp in groups]


def test_legs_group_by_connection_in_matched_order() -> None:
    a, b = _conn(1), _conn(2)
    p = Pending()
    for r, c in (("a1", a), ("b1", b), ("a2", a), ("b2", b), ("a3", a)):
        p.add(_ready(c, r))
    assert p
    assert _names(p.take()) == [["a1", "a2", "a3"], ["b1", "b2"]]
    assert not p and p.take() == []


def test_a_new_connection_object_to_the_same_peer_is_another_group() -> None:
    p = Pending()
    p.add(_ready(_conn(1), "old"))
    p.add(_ready(_conn(1), "new"))
    assert _names(p.take()) == [["old"], ["new"]]


def test_groups_are_cut_at_the_member_cap() -> None:
    c = _conn(1)
    p = Pending()
    for i in range(MAX_MEMBERS * 2 + 3):
        p.add(_ready(c, f"r{i}"))
    assert [len(g) for g in p.take()] == [MAX_MEMBERS, MAX_MEMBERS, 3]


def test_groups_are_cut_at_the_byte_cap() -> None:
    c = _conn(1)
    p = Pending()
    for i in range(5):
        p.add(_ready(c, f"r{i}", nbytes=MAX_BATCH_BYTES // 2))
    assert [len(g) for g in p.take()] == [2, 2, 1]


def test_groups_are_cut_before_the_notification_could_pass_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The member cap alone may keep a batch's ids small enough; lift it, so that only the
    # notification's own budget can cut the group.
    monkeypatch.setattr(coalesce, "MAX_MEMBERS", protocol.MAX_BATCH_DONE)
    c = _conn(1)
    p = Pending()
    for i in range(64):
        p.add(_ready(c, f"{i:03d}" + "x" * 253))  # ids of the longest kind: the worst case
    groups = p.take()
    assert len(groups) > 1
    assert all(len(g) < 64 for g in groups)
    codec = NotifCodec(Authenticator(TOKEN))
    cfg = EndpointConfig(role=Role.PREFILL)
    for g in groups:
        assert len(codec.encode(coalesce.notification(cfg, g))) < protocol.MAX_NOTIF_BYTES


def test_only_kvpush_d_legs_that_take_completions_and_fit_are_coalescable() -> None:
    c = _conn(1)
    on, off = EndpointConfig(role=Role.PREFILL), EndpointConfig(role=Role.PREFILL, coalesce=False)
    leg = _ready(c, "r")
    assert coalesce.coalescable(on, leg.registration, leg.plan)
    assert not coalesce.coalescable(off, leg.registration, leg.plan)
    old = Registration("r", _reg("r", batch_done=False), "d1", time.monotonic())
    assert not coalesce.coalescable(on, old, leg.plan)
    big = _ready(c, "big", nbytes=MAX_BATCH_BYTES + 1)
    assert not coalesce.coalescable(on, big.registration, big.plan)


# ------------------------------------------------------------------ the batch


def test_indices_are_every_legs_pairs_by_local_index() -> None:
    c = _conn(1)
    g = [_ready(c, "a", idx=[1, 2]), _ready(c, "b", idx=[7, 9])]
    lidx, ridx, nbytes = coalesce.indices(g)
    assert lidx == [1, 2, 7, 9] and ridx == [1, 2, 7, 9] and nbytes == 2048


def test_indices_order_interleaved_regions_so_runs_follow_on() -> None:
    """Two 1-block legs of a 2-region pool (block i in region r is r * 100 + i), matched in
    turn: K, V, K, V as concatenated; K, K, V, V once ordered, each pair kept whole."""
    c = _conn(1)
    g = [
        _ready(c, "a", idx=[5, 105], ridx=[40, 140]),
        _ready(c, "b", idx=[6, 106], ridx=[41, 141]),
    ]
    lidx, ridx, _ = coalesce.indices(g)
    assert lidx == [5, 6, 105, 106] and ridx == [40, 41, 140, 141]


def test_indices_keep_each_pair_whatever_the_order() -> None:
    c = _conn(1)
    g = [_ready(c, "a", idx=[9, 3], ridx=[1, 2]), _ready(c, "b", idx=[4], ridx=[7])]
    lidx, ridx, _ = coalesce.indices(g)
    assert list(zip(lidx, ridx, strict=True)) == [(3, 2), (4, 7), (9, 1)]


def test_indices_order_arrays_too() -> None:
    c = _conn(1)
    g = [
        _ready(c, "a", idx=[7, 107], ridx=[1, 2]),
        _ready(c, "b", idx=np.array([8, 108], dtype=np.int32), ridx=[3, 4]),
    ]
    lidx, ridx, _ = coalesce.indices(g)
    assert isinstance(lidx, np.ndarray) and lidx.dtype == np.int32
    assert lidx.tolist() == [7, 8, 107, 108] and np.asarray(ridx).tolist() == [1, 3, 2, 4]


def test_the_notification_names_each_member_as_its_completion_would() -> None:
    c = _conn(1)
    cfg = EndpointConfig(role=Role.PREFILL, tp_size=2, tp_rank=1)
    note = coalesce.notification(cfg, [_ready(c, "a", nbytes=5), _ready(c, "b", nbytes=6)])
    assert (note.p_tp_size, note.p_tp_rank) == (2, 1)
    assert [(d.request_id, d.transfer_id, d.nbytes) for d in note.done] == [
        ("a", "a", 5),
        ("b", "b", 6),
    ]
