"""Unit tests of the pattern: determinism, tag layout, slicing, and what it tells apart."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvpush.memory.pattern import (
    TAG_BYTES,
    base_row,
    expected_blocks,
    transfer_digest,
    transfer_seed,
    write_expected,
)


def test_transfer_seed_is_stable_64_bit_blake2b() -> None:
    digest = hashlib.blake2b(b"req-1", digest_size=8).digest()
    assert transfer_digest("req-1") == digest
    assert transfer_seed("req-1") == int.from_bytes(digest, "little")
    assert transfer_seed("req-1") == transfer_seed("req-1")
    assert transfer_seed("req-1") != transfer_seed("req-2")
    assert 0 <= transfer_seed("") < 2**64


def test_shape_dtype_and_determinism() -> None:
    a = expected_blocks("t", 3, 5, 64)
    assert a.shape == (3, 5, 64)
    assert a.dtype == np.uint8
    assert a.flags.c_contiguous
    assert np.array_equal(a, expected_blocks("t", 3, 5, 64))


def test_tag_layout_little_endian() -> None:
    a = expected_blocks("tid", 2, 4, 32)
    digest = np.frombuffer(transfer_digest("tid"), dtype=np.uint8)
    for r in range(2):
        for j in range(4):
            block = a[r, j]
            assert np.array_equal(block[:8], digest)
            assert int.from_bytes(block[8:12].tobytes(), "little") == r
            assert int.from_bytes(block[12:16].tobytes(), "little") == j


def test_body_is_base_plus_one_offset_per_block() -> None:
    bb = 256
    a = expected_blocks("x", 2, 3, bb).astype(np.int64)
    base = base_row(bb).astype(np.int64)
    body = (a[:, :, TAG_BYTES:] - base[TAG_BYTES:]) % 256
    # one offset per (region, j): every byte of the body shares it
    assert np.all(body == body[:, :, :1])


def test_base_row_cached_and_pseudo_random() -> None:
    row = base_row(4096)
    assert base_row(4096) is row
    assert row.dtype == np.uint8
    assert row.shape == (4096,)
    # not a constant or short period: a block shifted within itself fails
    assert len(np.unique(row)) > 200
    assert not np.array_equal(row[1:], row[:-1])


def test_first_j_slices_match_the_whole() -> None:
    whole = expected_blocks("slice", 4, 10, 48)
    part = expected_blocks("slice", 4, 6, 48, first_j=3)
    assert np.array_equal(part, whole[:, 3:9])


def test_write_expected_into_strided_view() -> None:
    pool = np.zeros((4, 10, 40), dtype=np.uint8)
    write_expected(pool[:, 2:7], "v", first_j=1)
    assert np.array_equal(pool[:, 2:7], expected_blocks("v", 4, 5, 40, first_j=1))
    assert not pool[:, :2].any() and not pool[:, 7:].any()  # only the view was written
    assert int(pool[:, :2].sum()) == 0
    assert int(pool[:, 7:].sum()) == 0


@pytest.mark.parametrize("bb", [16, 64, 4096])
def test_every_block_differs_from_every_other(bb: int) -> None:
    a = expected_blocks("a", 4, 8, bb).reshape(32, bb)
    b = expected_blocks("b", 4, 8, bb).reshape(32, bb)
    rows = np.concatenate([a, b])
    assert len(np.unique(rows, axis=0)) == 64  # no two (transfer, region, j) blocks alike


def test_small_blocks_without_tag_still_mostly_differ() -> None:
    a = expected_blocks("a", 8, 64, 8)
    b = expected_blocks("b", 8, 64, 8)
    differ = (a != b).any(axis=2)
    assert differ.mean() > 0.9  # offsets collide with probability 1/256
    assert np.array_equal(a, expected_blocks("a", 8, 64, 8))


def test_empty_and_bad_geometry() -> None:
    assert expected_blocks("e", 2, 0, 64).shape == (2, 0, 64)
    with pytest.raises(ValueError):
        expected_blocks("e", 2, 1, 0)
    with pytest.raises(ValueError):
        expected_blocks("e", 2, 1, 8, first_j=-1)
    with pytest.raises(ValueError):
        write_expected(np.zeros((2, 2), dtype=np.uint8), "e")
