"""Frozen configuration: validation messages and hints, addresses, derived values."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from kvpush.address import format_address, parse_address
from kvpush.config import AgentConfig, EndpointConfig, KvRegions, PoolConfig, Role, Timeouts
from kvpush.errors import ConfigError, ExitStatus


def err(fn: Callable[..., object], *a: object, **kw: object) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        fn(*a, **kw)
    assert ei.value.exit_status == ExitStatus.USAGE
    return ei.value


# ------------------------------------------------------------------ pool


def test_pool_defaults_and_derived_values() -> None:
    p = PoolConfig(num_blocks=10, layers=3, block_bytes=256)
    assert p.regions == 6
    assert p.bytes_per_block_all_regions == 6 * 256
    assert p.total_bytes == 6 * 10 * 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_blocks = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "message", "hint"),
    [
        ({"num_blocks": 0}, "--num-blocks must be positive, got 0", "pass --num-blocks > 0"),
        ({"layers": -1}, "--layers must be positive, got -1", "pass --layers > 0"),
        ({"block_bytes": 0}, "--block-bytes must be positive, got 0", "pass --block-bytes > 0"),
        (
            {"num_blocks": 2**31},
            "--num-blocks 2147483648 is too large",
            "use at most 2^31-1",
        ),
        (
            {"device": "gpu"},
            "unknown device 'gpu'",
            "use 'cpu', 'cuda' or 'cuda:N' (N = GPU index)",
        ),
        ({"device": "cuda:x"}, "unknown device 'cuda:x'", None),
        (
            {"dtype": "int4"},
            "unknown dtype 'int4'",
            "choose one of bf16, bfloat16, float16, float32, fp16, fp32, fp8, int8, uint8",
        ),
        (
            {"block_bytes": 6, "dtype": "float32"},
            "--block-bytes 6 is not a multiple of the float32 size",
            "pick a block size that holds whole elements",
        ),
    ],
)
def test_pool_validation(kw: dict[str, object], message: str, hint: str | None) -> None:
    e = err(PoolConfig, **kw)
    assert str(e) == message
    if hint is not None:
        assert e.hint == hint


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:15"])
def test_pool_devices_accepted(device: str) -> None:
    assert PoolConfig(device=device).device == device


def test_pool_from_model() -> None:
    p = PoolConfig.from_model(
        num_blocks=8, layers=2, block_tokens=16, kv_heads=4, head_dim=64, dtype="bf16"
    )
    assert p.block_bytes == 16 * 4 * 64 * 2 and p.dtype == "bf16" and p.regions == 4
    # one region per layer holds K and V in each block (an MLA latent only itself)
    both = PoolConfig.from_model(
        num_blocks=8,
        layers=2,
        block_tokens=16,
        kv_heads=4,
        head_dim=64,
        dtype="bf16",
        kv_regions=KvRegions.PER_LAYER,
    )
    assert both.block_bytes == 2 * p.block_bytes and both.regions == 2
    mla = PoolConfig.from_model(
        num_blocks=8,
        layers=2,
        block_tokens=16,
        kv_heads=1,
        head_dim=576,
        dtype="bf16",
        kv_regions=KvRegions.PER_LAYER,
        kv_layout="MLA",
    )
    assert mla.block_bytes == 16 * 576 * 2 and mla.regions == 2
    kw: dict[str, object] = {"num_blocks": 8, "layers": 2, "kv_heads": 4, "head_dim": 64}
    e = err(PoolConfig.from_model, block_tokens=0, dtype="bf16", **kw)
    assert str(e) == "--block-tokens must be positive, got 0"
    e = err(PoolConfig.from_model, block_tokens=16, dtype="int3", **kw)
    assert str(e) == "unknown dtype 'int3'"


# ------------------------------------------------------------------ agent


@pytest.mark.parametrize(
    ("kw", "message", "hint"),
    [
        ({"backends": ()}, "--backends is empty", "name at least one NIXL backend, e.g. UCX"),
        ({"backends": ("UCX", "U CX")}, "invalid backend name 'U CX'", "e.g. --backends UCX"),
        ({"num_threads": -1}, "--nixl-threads must be >= 0", "0 lets NIXL choose"),
        (
            {"idle_poll_max_us": 0},
            "--idle-poll-max-us must be positive, got 0",
            "pass --idle-poll-max-us > 0",
        ),
        (
            {"busy_spin_us": -5},
            "--busy-spin-us must be >= 0",
            "0 disables spinning after activity",
        ),
    ],
)
def test_agent_validation(kw: dict[str, object], message: str, hint: str) -> None:
    e = err(AgentConfig, **kw)
    assert (str(e), e.hint) == (message, hint)


def test_agent_defaults_keep_the_progress_thread_off() -> None:
    a = AgentConfig()
    assert a.backends == ("UCX",) and a.progress_thread is False


# ------------------------------------------------------------------ timeouts


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("side_channel_s", "--side-channel-timeout"),
        ("handshake_s", "--handshake-timeout"),
        ("lease_s", "--lease"),
        ("heartbeat_s", "--heartbeat"),
        ("request_deadline_s", "--request-deadline"),
        ("peer_idle_ttl_s", "--peer-idle-ttl"),
        ("write_base_s", "--write-timeout"),
        ("write_min_gbps", "--write-min-gbps"),
        ("fence_s", "--fence-timeout"),
        ("drain_s", "--drain-timeout"),
    ],
)
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_timeouts_name_the_real_option(field: str, flag: str, value: float) -> None:
    e = err(Timeouts, **{field: value})
    assert str(e) == f"{flag} must be positive, got {value}"
    assert e.hint == f"pass {flag} > 0"


def test_heartbeat_must_be_shorter_than_the_lease() -> None:
    e = err(Timeouts, lease_s=10.0, heartbeat_s=10.0)
    assert str(e) == "heartbeat interval 10.0s must be shorter than the lease 10.0s"
    assert e.hint == "use a heartbeat of at most a third of the lease"
    Timeouts(lease_s=10.0, heartbeat_s=3.0)


def test_write_deadline_is_size_aware() -> None:
    t = Timeouts(write_base_s=2.0, write_min_gbps=0.5)
    assert t.write_deadline_s(0) == 2.0
    assert t.write_deadline_s(10**9) == pytest.approx(4.0)


# ------------------------------------------------------------------ endpoint


def test_endpoint_defaults() -> None:
    c = EndpointConfig(role=Role.DECODE)
    assert c.host == "127.0.0.1"  # loopback unless told otherwise
    assert c.engine_id.startswith("d-") and len(c.engine_id) == 14
    assert EndpointConfig(role=Role.DECODE).engine_id != c.engine_id
    assert EndpointConfig(role=Role.PREFILL, engine_id="p.1:a@b_c-d").engine_id == "p.1:a@b_c-d"


@pytest.mark.parametrize(
    ("kw", "message", "hint"),
    [
        ({"role": "router"}, "unknown role 'router'", "use prefill or decode"),
        ({"port": 70000}, "invalid port 70000", "use 1-65535, or 0 to pick a free port"),
        ({"port": -1}, "invalid port -1", "use 1-65535, or 0 to pick a free port"),
        (
            {"engine_id": "has space"},
            "invalid engine id 'has space'",
            "use up to 128 letters, digits and . _ : @ -",
        ),
        ({"engine_id": "x" * 129}, f"invalid engine id '{'x' * 129}'", None),
        ({"tp_size": 0}, "--tp must be positive, got 0", "pass --tp > 0"),
        (
            {"tp_size": 2, "tp_rank": 2},
            "--tp-rank 2 is outside 0..1",
            "tp rank must be below tp size",
        ),
        ({"tp_rank": -1}, "--tp-rank -1 is outside 0..0", None),
        (
            {"host": "0.0.0.0"},
            "refusing to bind the side channel to all interfaces (0.0.0.0)",
            "pass --expose to bind every interface on purpose (and set --auth-token-file)",
        ),
        ({"host": "::"}, "refusing to bind the side channel to all interfaces (::)", None),
        ({"host": "*"}, "refusing to bind the side channel to all interfaces (*)", None),
        (
            {"auth_token": b"short"},
            "auth token is shorter than 16 bytes",
            "generate one: head -c 32 /dev/urandom | xxd -p",
        ),
    ],
)
def test_endpoint_validation(kw: dict[str, object], message: str, hint: str | None) -> None:
    base: dict[str, object] = {"role": "prefill"}
    base.update(kw)
    e = err(EndpointConfig, **base)
    assert str(e) == message
    if hint is not None:
        assert e.hint == hint


def test_all_interfaces_only_on_purpose() -> None:
    c = EndpointConfig(role=Role.PREFILL, host="0.0.0.0", allow_all_interfaces=True)
    assert c.host == "0.0.0.0"


# ------------------------------------------------------------------ addresses


@pytest.mark.parametrize(
    ("text", "default", "expect"),
    [
        ("127.0.0.1:5600", None, ("127.0.0.1", 5600)),
        ("  host.example:1  ", None, ("host.example", 1)),
        ("tcp://10.0.0.1:65535", None, ("10.0.0.1", 65535)),
        ("[::1]:5600", None, ("::1", 5600)),
        ("[fe80::1%eth0]:7", None, ("fe80::1%eth0", 7)),
        ("myhost", 5600, ("myhost", 5600)),
        ("[::1]", 5600, ("::1", 5600)),
    ],
)
def test_parse_address(text: str, default: int | None, expect: tuple[str, int]) -> None:
    assert parse_address(text, default) == expect


@pytest.mark.parametrize(
    ("text", "message", "hint"),
    [
        ("myhost", "address 'myhost' has no port", "use HOST:PORT, e.g. 127.0.0.1:5600"),
        ("myhost:", "address 'myhost:' has no port", None),
        (":5600", "invalid address ':5600'", "use HOST:PORT, e.g. 127.0.0.1:5600"),
        ("my host:1", "invalid address 'my host:1'", None),
        ("a/b:1", "invalid address 'a/b:1'", None),
        ("h:0", "invalid port in address 'h:0'", "ports are 1-65535"),
        ("h:65536", "invalid port in address 'h:65536'", None),
        ("h:http", "invalid port in address 'h:http'", None),
        ("h:-1", "invalid port in address 'h:-1'", None),
        ("[::1]:x", "invalid port in address '[::1]:x'", None),
    ],
)
def test_parse_address_errors(text: str, message: str, hint: str | None) -> None:
    e = err(parse_address, text)
    assert str(e) == message
    if hint is not None:
        assert e.hint == hint


@pytest.mark.parametrize("hp", [("127.0.0.1", 1), ("::1", 5600), ("host", 80)])
def test_format_parse_round_trip(hp: tuple[str, int]) -> None:
    assert parse_address(format_address(*hp)) == hp
    assert format_address("::1", 5600) == "[::1]:5600"
