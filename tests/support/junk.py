"""Malformed input for the fault suites, deterministic from a seed.

``junk_frames``: malformed, oversized and nonsensical side-channel requests as DEALER frame lists;
``junk_notifs``: malformed, oversized and nonsensical NIXL notifications (the forger sends them,
``tests.support.forger``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def junk_frames(seed: int, n: int, max_frame: int) -> Iterator[list[bytes]]:
    """Malformed side-channel requests as DEALER frame lists (ZMQ adds the identity)."""
    from kvpush import PROTOCOL_VERSION
    from kvpush.wire import protocol

    rng = random.Random(seed)

    def rb(k: int) -> bytes:
        return rng.randbytes(k)

    enc = protocol.encode
    kinds = [
        lambda: [b"", rb(rng.randint(0, 300))],
        lambda: [rb(rng.randint(1, 50))],
        lambda: [b"", b""],
        lambda: [b"x", b"y", b"z", b"w"],
        lambda: [b"", protocol.MAGIC_REQ + rb(rng.randint(0, 500))],
        lambda: [b"", protocol.MAGIC_REQ + protocol.make_envelope_bytes(rb(64))],
        lambda: [b"", protocol.MAGIC_REQ + enc([PROTOCOL_VERSION + 7, 0.0, b"", b"", b""])],
        lambda: [b"", protocol.MAGIC_REQ + protocol.make_envelope_bytes(enc({"type": "nope"}))],
        lambda: [
            b"",
            protocol.MAGIC_REQ
            + protocol.make_envelope_bytes(
                enc(
                    {
                        "type": "decode",
                        "transfer_id": "x" * 5000,
                        "prefill_host": "h",
                        "prefill_port": -1,
                        "num_blocks": 0,
                    }
                )
            ),
        ],
        lambda: [
            b"",
            protocol.MAGIC_REQ
            + protocol.make_envelope_bytes(
                enc({"type": "prefill", "transfer_id": "j", "num_blocks": 1 << 40})
            ),
        ],
        lambda: [b"", protocol.MAGIC_REQ + rb(max_frame + 1)],  # oversized (soft limit)
        lambda: [b"", enc(["get_meta_msg", "x", None])],
        lambda: [b"", enc([1] * 100)],
    ]
    for i in range(n):
        yield kinds[i % len(kinds)]()


def junk_notifs(seed: int, count: int) -> Iterator[bytes]:
    from kvpush import PROTOCOL_VERSION
    from kvpush.wire import protocol
    from kvpush.wire.auth import Authenticator
    from kvpush.wire.notifs import NotifCodec

    rng = random.Random(seed)
    codec = NotifCodec(Authenticator(None))
    enc = protocol.encode

    def rb(k: int) -> bytes:
        return rng.randbytes(k)

    def rid() -> str:
        return f"junk-{rng.randrange(1 << 30)}"

    kinds = [
        lambda: rb(rng.randint(1, 2000)),
        lambda: rb(256 << 10),  # 256 KiB: over the 64 KiB notification limit
        lambda: protocol.MAGIC_NOTIF + rb(rng.randint(0, 400)),
        lambda: protocol.MAGIC_NOTIF + protocol.make_envelope_bytes(rb(rng.randint(0, 400))),
        lambda: protocol.MAGIC_NOTIF + enc([PROTOCOL_VERSION + 9, 0.0, b"", b"", b""]),
        lambda: protocol.MAGIC_NOTIF + protocol.make_envelope_bytes(enc({"type": "zzz"})),
        lambda: b"PUSH_REG:" + rb(rng.randint(0, 200)),
        lambda: b"PUSH_REG:" + enc({"request_id": 5, "local_block_ids": "x"}),
        lambda: b"HB:" + rb(50),
        lambda: codec.encode(protocol.Completion(request_id=rid(), nbytes=1 << 40)),
        lambda: codec.encode(
            protocol.Failure(request_id=rid(), reason="junk", may_have_written=True)
        ),
        lambda: codec.encode(protocol.Fence(fence_id="f", request_ids=[rid() for _ in range(64)])),
        lambda: codec.encode(protocol.Heartbeat(transfer_ids=[rid() for _ in range(256)])),
        lambda: codec.encode(protocol.Cancel(request_id=rid(), transfer_id=rid())),
        lambda: (
            protocol.MAGIC_NOTIF
            + protocol.make_envelope_bytes(
                enc(
                    {
                        "type": "push_reg",
                        "request_id": "r",
                        "decode_engine_id": "e",
                        "decode_host": "h",
                        "decode_port": 70000,
                        "local_block_ids": [[-1]],
                        "remote_engine_id": "p",
                        "remote_host": "h",
                        "remote_port": 1,
                    }
                )
            )
        ),
    ]
    for i in range(count):
        yield kinds[i % len(kinds)]()
