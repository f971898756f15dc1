"""The decliner's batching (``kvpush.runtime.decline.batched``): pure, no sockets."""

from __future__ import annotations

from kvpush.config import Role
from kvpush.runtime.decline import batched
from kvpush.wire import protocol
from kvpush.wire.side_messages import MAX_DECLINE_BATCH


def _d(tid: str, reason: str = "no_free_blocks", detail: str = "") -> protocol.DeclineReq:
    return protocol.DeclineReq(
        transfer_id=tid, request_id=f"d-{tid}", reason=reason, detail=detail, origin=Role.DECODE
    )


def test_ds_declines_to_one_p_for_one_reason_go_together() -> None:
    items = [
        ("p1:1", _d("a")),
        ("p2:1", _d("b")),
        ("p1:1", _d("c", detail="need 2, 0 free")),  # one reason, another detail: merged
        ("p1:1", _d("d", reason="incompatible")),
        ("p1:1", _d("e")),
    ]
    got = [(a, m.transfer_id, m.also, n) for a, m, n in batched(items)]
    assert got == [
        ("p1:1", "a", ["c", "e"], 3),
        ("p2:1", "b", [], 1),
        ("p1:1", "d", [], 1),
    ]


def test_ps_declines_name_a_request_and_stay_alone() -> None:
    p_side = protocol.DeclineReq(
        transfer_id="t", request_id="r", reason="shutting_down", origin=Role.PREFILL
    )
    got = batched([("d:1", p_side), ("d:1", p_side)])
    assert [(m, n) for _, m, n in got] == [(p_side, 1), (p_side, 1)]


def test_a_batch_is_bounded_and_round_trips() -> None:
    items = [("p:1", _d(f"t{i}")) for i in range(MAX_DECLINE_BATCH + 5)]
    got = batched(items)
    assert [n for _, _, n in got] == [MAX_DECLINE_BATCH + 1, 4]
    assert sum(n for _, _, n in got) == len(items)
    first = got[0][1]
    back = protocol.decode_request_body(protocol.encode(first))
    assert back == first and len(back.also) == MAX_DECLINE_BATCH
