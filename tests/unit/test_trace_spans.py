"""The pure parts of kvpush's traces (``kvpush.telemetry.tracing``): a request's stamps into its
child spans, the W3C traceparent, and the options and variables that turn tracing on."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from kvpush.config import TracingConfig
from kvpush.errors import ConfigError, ProtocolError
from kvpush.telemetry import phases as ph
from kvpush.telemetry.tracing import check_traceparent, resolve
from kvpush.telemetry.tracing.spans import (
    BLOCKS_FINISHED,
    D_CHAIN,
    P_CHAIN,
    P_PUSH,
    attributes,
    format_traceparent,
    parse_traceparent,
    sampled,
    steps,
)
from kvpush.wire import protocol

D_ALL = {
    ph.D_ALLOCATED: 1.0,
    ph.PUSH_REG_SENT: 2.0,
    ph.COMPLETION_RECEIVED: 5.0,
    ph.VERIFIED: 6.0,
    ph.ANSWERED: 6.5,
}


def _names(got: tuple) -> list[str]:
    return [s.name.rsplit(".", 1)[1] for s in got]


def test_every_stamped_step_in_order_end_to_end() -> None:
    got = steps(D_CHAIN, 0.5, D_ALL, 7.0)
    assert _names(got) == ["allocate", "register", "push_wait", "verify", "answer"]
    assert [(s.t0, s.t1) for s in got] == [
        (0.5, 1.0),
        (1.0, 2.0),
        (2.0, 5.0),
        (5.0, 6.0),
        (6.0, 6.5),
    ]
    assert [s.phase for s in got] == [name for _, _, name in D_CHAIN]
    assert not any(s.error for s in got)


def test_without_verification_the_answer_starts_at_the_completion() -> None:
    stamps = {k: v for k, v in D_ALL.items() if k != ph.VERIFIED}
    got = steps(D_CHAIN, 0.5, stamps, 7.0)
    assert _names(got) == ["allocate", "register", "push_wait", "answer"]
    assert (got[-1].t0, got[-1].t1) == (5.0, 6.5)


def test_a_failed_request_ends_with_the_step_it_failed_in() -> None:
    stamps = {ph.D_ALLOCATED: 1.0, ph.PUSH_REG_SENT: 2.0, ph.ANSWERED: 9.0}
    got = steps(D_CHAIN, 0.5, stamps, 9.0, "prefill_unreachable")
    assert _names(got) == ["allocate", "register", "push_wait"]
    last = got[-1]
    assert (last.t0, last.t1, last.phase, last.error) == (2.0, 9.0, "", "prefill_unreachable")
    refused = steps(D_CHAIN, 0.5, {ph.ANSWERED: 0.6}, 0.6, "no_free_blocks")
    assert _names(refused) == ["allocate"] and refused[0].error == "no_free_blocks"


def test_a_failed_push_without_stamps_ends_with_the_push_itself() -> None:
    got = steps(P_CHAIN, 0.0, {BLOCKS_FINISHED: 1.0}, 4.0, "write_error", P_PUSH)
    assert [s.name for s in got] == [P_CHAIN[0][0], P_PUSH]
    assert (got[1].t0, got[1].t1, got[1].error) == (1.0, 4.0, "write_error")


def test_steps_never_overlap() -> None:
    """P matched the registration a moment before its prefill leg stamped the blocks filled."""
    stamps = {
        BLOCKS_FINISHED: 2.0,
        ph.REGISTRATION_MATCHED: 1.9,
        ph.HANDSHAKE_DONE: 1.95,
        ph.WRITE_POSTED: 3.0,
        ph.WRITE_DONE: 4.0,
    }
    got = steps(P_CHAIN, 0.0, stamps, 4.0)
    assert len(got) == len(P_CHAIN)
    for a, b in itertools.pairwise(got):
        assert a.t0 <= a.t1 <= b.t0 <= b.t1, (a, b)
    assert (got[1].t0, got[1].t1) == (2.0, 2.0)  # matched "before" filled: no time


def test_traceparent_parse_format_and_sampled() -> None:
    tp = format_traceparent(0xABC, 0x12, 1)
    assert tp == f"00-{0xABC:032x}-{0x12:016x}-01"
    got = parse_traceparent(tp)
    assert got is not None and got.sampled and got.trace_id.endswith("abc")
    off = format_traceparent(0xABC, 0x12, 0)
    assert sampled(tp) and not sampled(off)
    assert sampled("") and sampled("junk")  # none, or not W3C's: a new trace here
    for bad in (
        "",
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # all-zero trace id
        "00-" + "1" * 32 + "-" + "0" * 16 + "-01",  # all-zero span id
        "ff-" + "1" * 32 + "-" + "1" * 16 + "-01",  # version ff
        "00-" + "1" * 32 + "-" + "1" * 16 + "-01-x",  # version 00 has four fields
        "00-" + "G" * 32 + "-" + "1" * 16 + "-01",
    ):
        assert parse_traceparent(bad) is None, bad
    assert parse_traceparent("01-" + "1" * 32 + "-" + "1" * 16 + "-01-more") is not None
    with pytest.raises(ConfigError, match="not a W3C traceparent"):
        check_traceparent("00-xyz")
    assert check_traceparent("") == ""


def test_resolve_the_flag_the_variable_and_the_switch() -> None:
    assert resolve(None, env={}) == TracingConfig("", 1.0)
    on = resolve("http://c:4318", 0.5, env={})
    assert on == TracingConfig("http://c:4318/v1/traces", 0.5)
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://c:4318/custom"}
    assert resolve(None, env=env).endpoint == "https://c:4318/custom"  # a path is kept
    assert resolve("http://flag:1/v1/traces", env=env).endpoint == "http://flag:1/v1/traces"
    assert resolve("http://c:4318", env={"OTEL_SDK_DISABLED": "true"}).endpoint == ""


@pytest.mark.parametrize(
    ("endpoint", "ratio", "env", "says"),
    [
        ("http://c:4318", 1.5, {}, "--otlp-sample-ratio must be in 0..1"),
        ("http://c:4318", -0.1, {}, "--otlp-sample-ratio must be in 0..1"),
        ("grpc://c:4317", 1.0, {}, "is not an http(s) URL"),
        ("c:4318", 1.0, {}, "is not an http(s) URL"),
        ("http://c:4318", 1.0, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "http/protobuf"),
    ],
)
def test_resolve_refuses_what_it_cannot_do(
    endpoint: str, ratio: float, env: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(endpoint, ratio, env=env)
    assert says in e.value.message and e.value.hint


def test_attributes_leave_out_empty_values() -> None:
    got = attributes({"a": "", "b": None, "c": 0, "d": False, "e": "x"})
    assert got == {"c": 0, "d": False, "e": "x"}


class _OldPrefillReq(msgspec.Struct, tag="prefill", frozen=True, kw_only=True):
    """``PrefillReq`` as a kvpush without traces declares it."""

    rid: int = 0
    transfer_id: str
    num_blocks: int
    request_id: str = ""
    digest: bool = False


def test_the_trace_context_is_optional_on_the_wire() -> None:
    tp = format_traceparent(7, 9, 1)
    new = protocol.PrefillReq(transfer_id="t", num_blocks=2, traceparent=tp, tracestate="k=v")
    old = msgspec.msgpack.decode(protocol.encode(new), type=_OldPrefillReq)  # an older peer
    assert (old.transfer_id, old.num_blocks) == ("t", 2)
    got = protocol.decode_request_body(msgspec.msgpack.encode(old))  # from an older peer
    assert isinstance(got, protocol.PrefillReq) and (got.traceparent, got.tracestate) == ("", "")
    back = protocol.decode_request_body(protocol.encode(new))
    assert isinstance(back, protocol.PrefillReq) and back.traceparent == tp
    dec = protocol.DecodeReq(
        transfer_id="t", prefill_host="h", prefill_port=1, num_blocks=1, traceparent=tp
    )
    again = protocol.decode_request_body(protocol.encode(dec))
    assert isinstance(again, protocol.DecodeReq) and again.traceparent == tp
    with pytest.raises(ProtocolError, match="traceparent"):  # bounded like every field
        protocol.decode_request_body(
            protocol.encode(msgspec.structs.replace(dec, traceparent="x" * 200))
        )
