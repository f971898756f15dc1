"""``Geometry.of``: a registry record's geometry read from an endpoint's pool or a peer's
metadata, every field the source's, the device in one vocabulary (``cpu`` / ``cuda``)."""

from __future__ import annotations

import msgspec
import pytest

from kvpush.config import MLA_LAYOUT, KvRegions, PoolConfig, Role
from kvpush.fleet.record import Geometry, device_of
from tests.support.fakes import make_metadata

#: (pool, the geometry it has in host memory: regions from ``kv_regions``, the rest as given)
CASES = [
    (
        PoolConfig(num_blocks=64, layers=2, block_bytes=4096, dtype="bfloat16"),
        Geometry(num_blocks=64, layers=2, regions=4, block_bytes=4096, dtype="bfloat16",
                 kv_layout="NHD", kv_heads=1, device="cpu"),
    ),
    (
        PoolConfig(num_blocks=300, layers=3, block_bytes=1024, dtype="float16", kv_heads=8,
                   tp_size=2, kv_layout="HND", kv_regions=KvRegions.PER_LAYER),
        Geometry(num_blocks=300, layers=3, regions=3, block_bytes=1024, dtype="float16",
                 kv_layout="HND", kv_heads=8, device="cpu"),
    ),
    (
        PoolConfig(num_blocks=7, layers=5, block_bytes=1152, dtype="bfloat16",
                   kv_layout=MLA_LAYOUT),
        Geometry(num_blocks=7, layers=5, regions=10, block_bytes=1152, dtype="bfloat16",
                 kv_layout=MLA_LAYOUT, kv_heads=1, device="cpu"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("pool", "want"), CASES)
def test_the_geometry_of_a_pool_is_every_field_of_it(pool: PoolConfig, want: Geometry) -> None:
    assert Geometry.of(pool, "DRAM") == want


@pytest.mark.parametrize(("pool", "want"), CASES)
def test_a_peer_s_metadata_gives_the_geometry_of_its_pool(pool: PoolConfig, want: Geometry) -> None:
    md = make_metadata(Role.DECODE, pool, engine_id="d", incarnation="i1")
    md = msgspec.structs.replace(md, kv_heads=pool.kv_heads)
    assert Geometry.of(md, "DRAM") == want


def test_the_device_is_cpu_or_cuda_whatever_nixl_calls_the_memory() -> None:
    pool = CASES[0][0]
    assert Geometry.of(pool, "VRAM").device == device_of("VRAM") == "cuda"
    assert Geometry.of(pool, "DRAM").device == device_of("DRAM") == "cpu"
    assert Geometry.of(pool, "VRAM") != Geometry.of(pool, "DRAM")


def test_a_geometry_of_a_pool_survives_the_record_s_json() -> None:
    g = Geometry.of(CASES[1][0], "DRAM")
    assert msgspec.json.decode(msgspec.json.encode(g), type=Geometry) == g
    assert msgspec.json.decode(msgspec.json.encode(g))["kv_heads"] == 8
