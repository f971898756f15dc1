"""``PushRegs`` (issue 30): several requests' PUSH_REGs in one notification. Through kvpush's
codec (sealed with a token too) each comes back exactly as its own ``PushReg``; D cuts its held
registrations into notifications P will take (``kvpush.decode.registrar._batches``); P's decoder
refuses more than ``MAX_BATCH_REGS``; vLLM's wire has no form for it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.decode.registrar import BATCH_REG_BYTES, _batches, _Held
from kvpush.errors import ProtocolError
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator
from kvpush.wire.notifs import NotifCodec, VllmNotifCodec


def _reg(rid: str, ids: list[int], **kw: object) -> protocol.PushReg:
    base = protocol.PushReg(
        request_id=rid,
        transfer_id=f"t-{rid}",
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=5600,
        local_block_ids=[ids],
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=5500,
        decode_incarnation="inc",
        batch_done=True,
    )
    return msgspec.structs.replace(base, **kw) if kw else base


def _held(reg: protocol.PushReg) -> _Held:
    # ``_batches`` reads only the registration
    return _Held(w=None, source=0, conn=None, reg=reg)  # type: ignore[arg-type]


ids_st = st.lists(st.integers(min_value=0, max_value=(1 << 31) - 1), max_size=40)
regs_st = st.lists(
    st.tuples(st.text(min_size=1, max_size=40), ids_st, st.integers(1, 4)),
    min_size=1,
    max_size=protocol.MAX_BATCH_REGS,
)


@settings(max_examples=60, deadline=None)
@given(regs=regs_st, token=st.sampled_from([None, b"s3cret"]))
def test_each_registration_comes_back_exactly_as_its_own_push_reg(
    regs: list[tuple[str, list[int], int]], token: bytes | None
) -> None:
    codec = NotifCodec(Authenticator(token))
    alone = [_reg(rid, ids, remote_pp_size=pp) for rid, ids, pp in regs]
    msg = codec.decode(codec.encode(protocol.PushRegs.of(alone)))
    assert isinstance(msg, protocol.PushRegs)
    assert msg.expand() == alone


def test_more_than_the_limit_is_refused_by_the_decoder() -> None:
    codec = NotifCodec(Authenticator(None))
    n = protocol.MAX_BATCH_REGS + 1
    big = protocol.PushRegs.of([_reg(f"r{i}", [i]) for i in range(n)])
    with pytest.raises(ProtocolError):
        codec.decode(codec.encode(big))


def test_vllm_wire_has_no_form_for_it() -> None:
    codec = VllmNotifCodec()
    msg = protocol.PushRegs.of([_reg("a", [1]), _reg("b", [2])])
    assert not codec.carries(msg)
    with pytest.raises(ProtocolError):
        codec.encode(msg)


def test_batches_keep_order_and_cut_at_the_count_the_bytes_and_a_differing_peer() -> None:
    n = protocol.MAX_BATCH_REGS + 3
    cuts = _batches([_held(_reg(f"r{i}", [i])) for i in range(n)])
    assert [len(b) for b in cuts] == [protocol.MAX_BATCH_REGS, 3]
    assert [h.reg.request_id for b in cuts for h in b] == [f"r{i}" for i in range(n)]

    many = BATCH_REG_BYTES // 5  # block ids: a registration this size fills a batch alone
    cuts = _batches(
        [_held(_reg("a", [1])), _held(_reg("b", list(range(many)))), _held(_reg("c", [2]))]
    )
    assert [[h.reg.request_id for h in b] for b in cuts] == [["a"], ["b"], ["c"]]

    other = _reg("y", [3], decode_tp_rank=1)  # another D rank: its own notification
    cuts = _batches([_held(_reg("x", [1])), _held(other), _held(_reg("z", [2]))])
    assert [[h.reg.request_id for h in b] for b in cuts] == [["x"], ["y"], ["z"]]


def test_a_full_batch_of_the_largest_fields_fits_the_default_notification_limit() -> None:
    codec = NotifCodec(Authenticator(b"k"))
    long = "x" * 256
    regs = [
        _reg(long[:-3] + f"{i:03d}", [(1 << 31) - 1], transfer_id=long, decode_host=long)
        for i in range(protocol.MAX_BATCH_REGS)
    ]
    cuts = _batches([_held(r) for r in regs])
    for b in cuts:
        data = codec.encode(protocol.PushRegs.of([h.reg for h in b]))
        assert len(data) <= protocol.MAX_NOTIF_BYTES
