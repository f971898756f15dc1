"""The wire protocol: round trips of every struct, limits, vLLM forms, and fuzzing.

Every decoder that sees bytes from the network must raise only ``ProtocolError`` (or
``AuthError`` where authentication applies) -- never anything else, whatever the input:
one malformed frame must not kill a side-channel, writer or receiver thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpush import PROTOCOL_VERSION
from kvpush.config import Role
from kvpush.errors import AuthError, ProtocolError
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import CH_NOTIF, CH_REQUEST, Authenticator
from kvpush.wire.notifs import NotifCodec
from tests.support.fakes import make_metadata, stub_pool

MD = make_metadata(Role.DECODE, stub_pool(), engine_id="d-1", incarnation="f" * 32, port=5600)

REQUESTS: list[protocol.SideRequest] = [
    protocol.HandshakeReq(rid=1, mode="full", requester="p-1"),
    protocol.StatsReq(rid=2),
    protocol.PrefillReq(rid=3, transfer_id="t", num_blocks=4, request_id="r"),
    protocol.DecodeReq(
        rid=4,
        transfer_id="t",
        prefill_host="::1",
        prefill_port=5600,
        num_blocks=2,
        request_id="r",
        deadline_s=2.5,
    ),
    protocol.PingReq(rid=5),
]
REPLIES: list[protocol.SideReply] = [
    protocol.HandshakeRep(
        rid=1,
        compat_hash=protocol.compat_hash(MD),
        metadata=protocol.encode_metadata(MD),
        agent_metadata=b"\x00agent\xff",
        server_clock=1234.5,
    ),
    protocol.StatsRep(rid=2, snapshot={"a": 1, "b": [1, 2], "c": {"d": "e"}}),
    protocol.PrefillRep(rid=3, transfer_id="t", outcome="failed", reason="x", latency_s=0.1),
    protocol.DecodeRep(
        rid=4,
        transfer_id="t",
        request_id="r",
        outcome="ok",
        detail="d",
        latency_s=0.2,
        nbytes=10,
        verified=True,
    ),
    protocol.ErrorRep(rid=5, code="c", message="m", hint="h"),
]
NOTIFS: list[protocol.Notif] = [
    protocol.PushReg(
        request_id="r",
        transfer_id="t",
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=1,
        decode_tp_size=2,
        local_block_ids=[[0, 5, 2**31 - 1]],
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=2,
        remote_tp_size=4,
        remote_pp_size=1,
        decode_incarnation="inc",
        decode_tp_rank=1,
    ),
    protocol.Completion(request_id="r", transfer_id="t", p_tp_size=2, p_tp_rank=1, nbytes=7),
    protocol.Heartbeat(transfer_ids=["a", "b"]),
    protocol.Failure(request_id="r", reason="x", detail="y", may_have_written=True),
    protocol.Cancel(request_id="r", transfer_id="t"),
    protocol.Fence(fence_id="f1", request_ids=["r1", "r2"]),
    protocol.Ping(seq=3, reply=True, reply_host="h", reply_port=9, sent_at=1.5),
]


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: type(r).__name__)
def test_request_round_trip(req: protocol.SideRequest) -> None:
    assert protocol.decode_request_body(protocol.encode(req)) == req


@pytest.mark.parametrize("rep", REPLIES, ids=lambda r: type(r).__name__)
def test_reply_round_trip(rep: protocol.SideReply) -> None:
    assert protocol.decode_reply_body(protocol.encode(rep)) == rep


@pytest.mark.parametrize("msg", NOTIFS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("token", [None, b"t" * 32], ids=["plain", "token"])
def test_notif_round_trip(msg: protocol.Notif, token: bytes | None) -> None:
    assert protocol.decode_notif_body(protocol.encode(msg)) == msg
    codec = NotifCodec(Authenticator(token))
    data = codec.encode(msg)
    assert data.startswith(protocol.MAGIC_NOTIF)
    assert NotifCodec(Authenticator(token)).decode(data) == msg


def test_metadata_round_trip() -> None:
    assert protocol.decode_metadata(protocol.encode_metadata(MD)) == MD
    loose = protocol.decode_metadata_loose(protocol.encode_metadata(MD))
    assert loose["engine_id"] == "d-1" and loose["regions"] == 4


def test_envelope_round_trip() -> None:
    data = protocol.MAGIC_REQ + protocol.make_envelope_bytes(
        b"body", tag=b"t" * 32, ts=12.5, nonce=b"n" * 16
    )
    env = protocol.decode_envelope(data, protocol.MAGIC_REQ, 1024, "request")
    assert env == protocol.Envelope(
        v=PROTOCOL_VERSION, ts=12.5, nonce=b"n" * 16, body=b"body", tag=b"t" * 32
    )


def test_vllm_structs_round_trip() -> None:
    vmd = vllm.AgentMetadata(
        engine_id="e", agent_metadata=b"a", kv_caches_base_addr=[1, 2], num_blocks=3
    )
    p = vllm.HandshakePayload(
        compatibility_hash="h", agent_metadata_bytes=msgspec.msgpack.encode(vmd)
    )
    got = vllm.decode_payload(msgspec.msgpack.encode(p))
    assert got == p
    assert vllm.decode_agent_metadata(got.agent_metadata_bytes) == vmd


def test_structs_encode_as_maps_keyed_by_field_name_with_a_type_tag() -> None:
    raw = msgspec.msgpack.decode(protocol.encode(protocol.Heartbeat(transfer_ids=["t"])))
    assert raw == {"type": "hb", "transfer_ids": ["t"]}


# ------------------------------------------------------------------ validation and limits


def test_envelope_checks() -> None:
    body = protocol.MAGIC_REQ + protocol.make_envelope_bytes(b"x")
    with pytest.raises(ProtocolError, match="request has no kvpush magic"):
        protocol.decode_envelope(body, protocol.MAGIC_NOTIF, 1024, "request")
    future = protocol.MAGIC_REQ + msgspec.msgpack.encode(
        protocol.Envelope(v=PROTOCOL_VERSION + 1, ts=0.0, nonce=b"", body=b"")
    )
    with pytest.raises(ProtocolError, match=f"request uses protocol v{PROTOCOL_VERSION + 1}"):
        protocol.decode_envelope(future, protocol.MAGIC_REQ, 1024, "request")


def test_size_limit_checked_before_decoding() -> None:
    # A valid frame one byte over the limit is refused for its size, not parsed.
    data = protocol.MAGIC_REQ + protocol.make_envelope_bytes(b"x" * 100)
    with pytest.raises(ProtocolError, match=f"request of {len(data)} bytes exceeds the"):
        protocol.decode_envelope(data, protocol.MAGIC_REQ, len(data) - 1, "request")
    assert protocol.decode_envelope(data, protocol.MAGIC_REQ, len(data), "request").body
    with pytest.raises(
        ProtocolError, match=r"endpoint metadata of \d+ bytes exceeds the 1048576-byte"
    ):
        protocol.decode_metadata(protocol.encode_metadata(MD) + b"\x00" * (1 << 20))
    big = vllm.PUSH_REG_PREFIX + b"\x80" * protocol.MAX_NOTIF_BYTES
    with pytest.raises(ProtocolError, match=r"PUSH_REG of \d+ bytes exceeds"):
        vllm.decode_push_reg(big)
    codec = NotifCodec(Authenticator(None), max_bytes=100)
    with pytest.raises(ProtocolError, match="notification of 101 bytes exceeds the 100-byte"):
        codec.decode(b"\x00" * 101)


@pytest.mark.parametrize(
    "bad",
    [
        protocol.Completion(request_id="x" * 257),
        protocol.Heartbeat(transfer_ids=["t"] * 4097),
        protocol.Ping(seq=-1),
        protocol.Ping(seq=1, reply_port=70000),
        protocol.Completion(request_id="r", p_tp_size=0),
    ],
    ids=["long_str", "long_list", "negative", "port", "tp_zero"],
)
def test_field_limits_enforced(bad: protocol.Notif) -> None:
    with pytest.raises(ProtocolError, match="malformed notification"):
        protocol.decode_notif_body(protocol.encode(bad))


def test_block_id_limits() -> None:
    ok = NOTIFS[0]
    assert isinstance(ok, protocol.PushReg)
    for ids in ([[2**31]], [[-1]], [[0]] * 65):
        bad = msgspec.structs.replace(ok, local_block_ids=ids)
        with pytest.raises(ProtocolError):
            protocol.decode_notif_body(protocol.encode(bad))


def test_unknown_tag_and_wrong_kind() -> None:
    with pytest.raises(ProtocolError, match="malformed side-channel request"):
        protocol.decode_request_body(msgspec.msgpack.encode({"type": "rm -rf"}))
    # A request is not a reply, even where the tags coincide (the reply's fields are missing).
    with pytest.raises(ProtocolError, match="malformed side-channel reply"):
        protocol.decode_reply_body(protocol.encode(REQUESTS[0]))


def test_compat_hash_covers_compat_fields_only() -> None:
    h = protocol.compat_hash(MD)
    assert len(h) == 32
    assert protocol.compat_hash(msgspec.structs.replace(MD, num_blocks=999, port=1)) == h
    for f, v in (("dtype", "bf16"), ("block_bytes", 128), ("layers", 3), ("kv_layout", "HND")):
        assert protocol.compat_hash(msgspec.structs.replace(MD, **{f: v})) != h
    other = msgspec.structs.replace(MD, dtype="bf16", layers=3)
    diffs = protocol.compat_differences(protocol.compat_fields(MD), protocol.compat_fields(other))
    assert diffs == [("dtype", "uint8", "bf16"), ("layers", 2, 3)]


# ------------------------------------------------------------------ vLLM forms


def test_vllm_get_meta_recognised() -> None:
    assert vllm.is_get_meta(vllm.get_meta_request(1, 3)) == (1, 3)
    assert vllm.is_get_meta(msgspec.msgpack.encode(("get_meta_msg", 0, 2))) == (0, 2)
    for frame in (
        msgspec.msgpack.encode((b"get_meta_msg", 0)),
        msgspec.msgpack.encode((b"other", 0, 0)),
        msgspec.msgpack.encode((b"get_meta_msg", "0", 0)),
        msgspec.msgpack.encode({"get_meta_msg": 1}),
        protocol.MAGIC_REQ + vllm.get_meta_request(),
        b"\xc1",
        b"",
        vllm.get_meta_request() + b" " * 300,
    ):
        assert vllm.is_get_meta(frame) is None


def test_vllm_push_reg_accepted() -> None:
    fields = {
        "request_id": "r1",
        "transfer_id": "t1",
        "decode_engine_id": "d",
        "decode_host": "10.0.0.2",
        "decode_port": 5601,
        "decode_tp_size": 1,
        "local_block_ids": [[3, 4, 5]],
        "remote_engine_id": "p",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_tp_size": 1,
        "remote_pp_size": 1,
        "some_future_vllm_field": {"x": 1},
    }
    data = vllm.PUSH_REG_PREFIX + msgspec.msgpack.encode(fields)
    for reg in (vllm.decode_push_reg(data), NotifCodec(Authenticator(None)).decode(data)):
        assert isinstance(reg, protocol.PushReg)
        assert (reg.request_id, reg.transfer_id, reg.decode_port) == ("r1", "t1", 5601)
        assert reg.local_block_ids == [[3, 4, 5]]
    with pytest.raises(AuthError, match="unauthenticated vLLM-form PUSH_REG refused"):
        NotifCodec(Authenticator(b"k" * 32)).decode(data)
    del fields["decode_port"]
    with pytest.raises(ProtocolError, match="malformed PUSH_REG"):
        vllm.decode_push_reg(vllm.PUSH_REG_PREFIX + msgspec.msgpack.encode(fields))


# ------------------------------------------------------------------ fuzzing

TOKEN = b"fuzz-token-0123456789"


def _valid_frames() -> list[bytes]:
    plain, sealed = Authenticator(None), Authenticator(TOKEN)
    frames: list[bytes] = []
    for obj in (*REQUESTS, *REPLIES, *NOTIFS):
        body = protocol.encode(obj)
        frames.append(body)
        frames.append(protocol.MAGIC_REQ + plain.seal(CH_REQUEST, body))
        frames.append(protocol.MAGIC_NOTIF + sealed.seal(CH_NOTIF, body))
    frames.append(protocol.encode_metadata(MD))
    frames.append(vllm.get_meta_request(0, 1))
    frames.append(vllm.PUSH_REG_PREFIX + msgspec.msgpack.encode(msgspec.to_builtins(NOTIFS[0])))
    return frames


VALID = _valid_frames()
_plain_codec = NotifCodec(Authenticator(None))
_sealed_codec = NotifCodec(Authenticator(TOKEN))

DECODERS: dict[str, Callable[[bytes], object]] = {
    "envelope_req": lambda b: protocol.decode_envelope(b, protocol.MAGIC_REQ, 1 << 20, "req"),
    "envelope_notif": lambda b: protocol.decode_envelope(b, protocol.MAGIC_NOTIF, 1 << 20, "n"),
    "request_body": protocol.decode_request_body,
    "reply_body": protocol.decode_reply_body,
    "notif_body": protocol.decode_notif_body,
    "metadata": protocol.decode_metadata,
    "metadata_loose": protocol.decode_metadata_loose,
    "notif_codec": _plain_codec.decode,
    "notif_codec_token": _sealed_codec.decode,
    "vllm_push_reg": vllm.decode_push_reg,
    "vllm_payload": vllm.decode_payload,
    "vllm_agent_metadata": vllm.decode_agent_metadata,
}


def _only_protocol_errors(data: bytes) -> None:
    for name, dec in DECODERS.items():
        try:
            dec(data)
        except (ProtocolError, AuthError):
            pass
        except Exception as e:  # pragma: no cover - this is the failure being hunted
            raise AssertionError(f"{name} raised {type(e).__name__}: {e!r} on {data[:64]!r}") from e
    got = vllm.is_get_meta(data)  # a predicate: never raises
    assert got is None or (isinstance(got, tuple) and len(got) == 2)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "truncate", "prefix"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "truncate":
            del data[i:]
        else:
            data[:0] = draw(
                st.sampled_from([protocol.MAGIC_REQ, protocol.MAGIC_NOTIF, vllm.PUSH_REG_PREFIX])
            )
    return bytes(data)


DEEP = b"\x81\xa1x" + b"\x91" * 20_000 + b"\xc0"


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=512))
@example(b"")
@example(DEEP)
@example(protocol.MAGIC_NOTIF + b"\x95\x01\xcb" + b"\x00" * 8 + b"\xc4\x00" + DEEP)
@example(vllm.PUSH_REG_PREFIX + DEEP)
@example(b"\xdd\xff\xff\xff\xff")  # an array claiming 4G elements
@example(b"\xd6\xff\xff\xff\xff\xff")  # a msgpack timestamp extension
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    _only_protocol_errors(data)


@settings(max_examples=400, deadline=None, database=None)
@given(mutated())
def test_mutated_frames_raise_only_protocol_errors(data: bytes) -> None:
    _only_protocol_errors(data)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_deeply_nested_input_is_a_protocol_error(name: str) -> None:
    # msgspec recurses into nested values (even of unknown fields it skips); past Python's
    # recursion limit that was a RecursionError escaping every decoder.
    # An envelope is an array: give it a deeply nested extra (sixth) element.
    deep_env = b"\x96\x01\xcb" + b"\x00" * 8 + b"\xc4\x00" * 3 + DEEP
    data = {
        "envelope_req": protocol.MAGIC_REQ + deep_env,
        "envelope_notif": protocol.MAGIC_NOTIF + deep_env,
        "notif_codec": vllm.PUSH_REG_PREFIX + DEEP,
        "notif_codec_token": protocol.MAGIC_NOTIF + deep_env,
        "vllm_push_reg": vllm.PUSH_REG_PREFIX + DEEP,
    }.get(name, DEEP)
    with pytest.raises((ProtocolError, AuthError)):
        DECODERS[name](data)


def test_decoding_is_fast_on_a_large_frame() -> None:
    # A budget sanity check, not a benchmark: a frame at the limit decodes promptly.
    t0 = time.perf_counter()
    with pytest.raises(ProtocolError):
        protocol.decode_request_body(b"\x91" * (protocol.MAX_FRAME_BYTES - 16))
    assert time.perf_counter() - t0 < 5.0


def test_a_cancel_names_the_request_and_d_incarnation_of_its_push_reg() -> None:
    reg = next(m for m in NOTIFS if isinstance(m, protocol.PushReg))
    c = protocol.Cancel.of(reg)
    assert (c.request_id, c.transfer_id, c.decode_incarnation) == ("r", "t", "inc")
    assert (c.decode_host, c.decode_port, c.decode_tp_rank) == ("127.0.0.1", 1, 1)
    # An older kvpush D's Cancel (no incarnation) still decodes: P then matches any.
    old = msgspec.json.encode({"type": "cancel", "request_id": "r"})
    assert msgspec.json.decode(old, type=protocol.Cancel).decode_incarnation == ""
