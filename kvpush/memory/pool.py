"""The registered KV memory of one endpoint: one torch allocation, fill / verify / scrub.

``KvPool`` owns the one torch allocation (DRAM or VRAM) that the NIXL adapter registers, its
``BlockAllocator`` (``kvpush.memory.allocator``) and ``fill`` / ``verify`` / ``scrub`` of blocks.
These take no lock: they are called by whichever thread currently owns the blocks in question
(the allocator says who that is). This module imports torch and numpy, never nixl or zmq.
"""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np
import torch

from kvpush.config import PoolConfig
from kvpush.errors import ConfigError, DeviceError
from kvpush.memory.allocator import BlockAllocator
from kvpush.memory.descriptors import block_descs
from kvpush.memory.pattern import TAG_BYTES, read_tag, transfer_digest, write_expected
from kvpush.wire.side_messages import DeviceKind

POISON_BYTE = 0xA5
"""What ``scrub`` writes: neither zero nor a likely pattern byte run, easy to spot in a dump."""
_POISON_WORD = int.from_bytes(bytes([POISON_BYTE]) * 8, "little", signed=True)  # as int64 words

_CHUNK_BYTES = 16 * 1024 * 1024  # fill/verify/scrub work in slices of this size (scratch x 2)


def rank_device(spec: str, rank: int) -> str:
    """Where rank ``rank`` keeps its pool: ``cuda`` -> ``cuda:rank``, ``cuda:N`` ->
    ``cuda:N+rank`` (one GPU per rank, as vLLM's workers), ``cpu`` -> ``cpu``."""
    if spec == "cpu" or not spec.startswith("cuda") or (rank == 0 and spec == "cuda"):
        return spec
    base = int(spec.partition(":")[2]) if ":" in spec else 0
    return f"cuda:{base + rank}"


def _resolve_device(spec: str) -> tuple[torch.device, DeviceKind, int]:
    """``cpu`` / ``cuda`` / ``cuda:N`` -> (torch device, "DRAM" | "VRAM", device id)."""
    if spec == "cpu":
        return torch.device("cpu"), "DRAM", 0
    if not torch.cuda.is_available():
        raise DeviceError(
            f"CUDA requested (--device {spec}) but this host has no usable CUDA device",
            hint="use --device cpu",
        )
    count = torch.cuda.device_count()
    index = int(spec.partition(":")[2]) if ":" in spec else torch.cuda.current_device()
    if index >= count:
        raise DeviceError(
            f"CUDA device {index} requested (--device {spec}) but this host has {count} "
            f"CUDA device{'s' if count != 1 else ''} (0..{count - 1})",
            hint=f"use --device cuda:N with N below {count}, or --device cpu",
        )
    return torch.device("cuda", index), "VRAM", index


def check_device(spec: str) -> str:
    """``DRAM`` or ``VRAM`` for a device spec usable here, else ``DeviceError`` (the same
    error and hint an endpoint gives), for commands that check before starting processes."""
    return _resolve_device(spec)[1]


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """View uint8 blocks as int64 words when the block size allows it.

    torch's element-wise CPU kernels (index_copy_, equal, index_fill_) move ~1 GB/s on uint8
    and ~10 GB/s on int64 here; the bytes are the same.
    """
    return t.view(torch.int64) if t.shape[-1] % 8 == 0 else t


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "cpu":
        # numpy compares int64 words at ~14 GB/s here; torch.equal varies between 4 and 14.
        return bool(np.array_equal(_as_words(a).numpy(), _as_words(b).numpy()))
    return torch.equal(_as_words(a), _as_words(b))


class KvPool:
    """One registered allocation per endpoint: uint8 tensor ``(regions, num_blocks, block_bytes)``.

    The tensor is allocated with ``torch.zeros``: touching every page up front makes an
    over-committed host fail here, at startup with a clear ``ConfigError``, rather than at the
    first transfer; it costs a fraction of a second per GiB. Region ``r`` starts at
    ``base_addr + r*region_stride``; block ``b`` of it at ``+ b*block_bytes``.

    ``fill`` / ``verify`` / ``scrub`` work on slices of at most ~16 MiB (or one block in every
    region, if larger); a run of consecutive ids is read and written in place, other ids go
    through one reusable scratch buffer per calling thread, so they allocate nothing after
    the first call and run at several GB/s.
    """

    def __init__(self, cfg: PoolConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        # The model heads this rank's pages hold (all of them when replicated).
        self._pat = {"heads": cfg.heads_per_rank, "first_head": cfg.first_head(rank)}
        self.device, self.device_kind, self.device_id = _resolve_device(
            rank_device(cfg.device, rank)
        )
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # fill/verify are many small ops: torch's intra-op thread pool only fights the
            # endpoint's owner threads for cores (measured: a 64 KiB verify took tens of ms
            # instead of ~0.2 ms on 2 cores, and D's p99 rose from ~10 ms to ~470 ms).
            torch.set_num_threads(1)
        shape = (cfg.regions, cfg.num_blocks, cfg.block_bytes)
        try:
            self.tensor = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate the KV pool: {cfg.total_bytes} bytes "
                f"({cfg.total_bytes / 2**30:.2f} GiB) on {cfg.device}: {exc}",
                hint="lower --num-blocks, --layers or --block-bytes",
            ) from exc
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.base_addr: int = self.tensor.data_ptr()
        self.region_stride: int = cfg.num_blocks * cfg.block_bytes
        self._chunk_blocks = max(1, _CHUNK_BYTES // cfg.bytes_per_block_all_regions)
        self._scratch = threading.local()

    def region_base_addrs(self) -> list[int]:
        return [self.base_addr + r * self.region_stride for r in range(self.cfg.regions)]

    def slice_descs(self, offset: int, length: int) -> np.ndarray:
        """Descriptors of ``length`` bytes at ``offset`` in every block of every region (a
        chunk of each page: what one D rank of a larger TP gets), region-major."""
        stride = [self.cfg.block_bytes] * self.cfg.regions
        return block_descs(
            self.region_base_addrs(), self.cfg.num_blocks, length, self.device_id, stride, offset
        )

    def all_block_descs(self) -> np.ndarray:
        """Descriptors of every block of every region (region-major), for registration/handshake."""
        return block_descs(
            self.region_base_addrs(), self.cfg.num_blocks, self.cfg.block_bytes, self.device_id
        )

    def fill(self, transfer_id: str, block_ids: np.ndarray) -> None:
        """Write the pattern of ``transfer_id`` into these blocks (position j = index in ids)."""
        for j0, ids in self._chunks(block_ids):
            start = _run_start(ids)
            if start is not None:
                write_expected(
                    self.tensor[:, start : start + ids.size], transfer_id, first_j=j0, **self._pat
                )
                continue
            exp = write_expected(
                self._scratch_view(0, ids.size), transfer_id, first_j=j0, **self._pat
            )
            _as_words(self.tensor).index_copy_(1, self._index(ids), _as_words(exp))

    def verify(self, transfer_id: str, block_ids: np.ndarray) -> bool:
        """True iff every byte of these blocks, in every region, equals the pattern."""
        for j0, ids in self._chunks(block_ids):
            exp = write_expected(
                self._scratch_view(0, ids.size), transfer_id, first_j=j0, **self._pat
            )
            start = _run_start(ids)
            if start is not None:
                got = self.tensor[:, start : start + ids.size]
            else:
                got = torch.index_select(
                    self.tensor, 1, self._index(ids), out=self._scratch_view(1, ids.size)
                )
            if not _equal(got, exp):
                return False
        return True

    def explain(self, transfer_id: str, block_ids: np.ndarray) -> str:
        """Why ``verify`` failed: the first head slice that differs, and what its tag says is
        there instead (which transfer, region, model head, position) -- so a head at the wrong
        offset, from the wrong rank or a stale block is named, not just "bytes differ"."""
        heads, first = self._pat["heads"], self._pat["first_head"]
        hb = self.cfg.block_bytes // heads
        ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
        for j, b in enumerate(ids.tolist()):
            exp = write_expected(
                self._scratch_view(0, 1), transfer_id, first_j=j, **self._pat
            ).view(self.cfg.regions, heads, hb)
            got = self.tensor[:, b].view(self.cfg.regions, heads, hb)
            for r in range(self.cfg.regions):
                for h in range(heads):
                    if _equal(got[r, h], exp[r, h]):
                        continue
                    where = (
                        f"rank {self.rank}, region {r}, block {b} (position {j}), head {first + h}"
                    )
                    if hb < TAG_BYTES:
                        return f"{where}: bytes differ"
                    digest, fr, fh, fj = read_tag(got[r, h].cpu().numpy())
                    if digest != transfer_digest(transfer_id):
                        return f"{where}: holds bytes of another transfer (or none)"
                    return f"{where}: holds region {fr}, head {fh}, position {fj} instead"
        return "every head slice matches"

    def digest(self, block_ids: np.ndarray) -> str:
        """sha256 (hex) of these blocks' bytes: region by region in region order, each region's
        blocks in the given order -- the digest a vLLM-wire peer reports for the same bytes."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
        h = hashlib.sha256()
        for r in range(self.cfg.regions):
            for _, part in self._chunks(ids):
                rows = self.tensor[r].index_select(0, self._index(part))
                h.update(np.ascontiguousarray(rows.cpu().numpy()).data)
        return h.hexdigest()

    def region_rows(self, region: int, block_ids: np.ndarray) -> np.ndarray:
        """The bytes of these blocks of one region: uint8 ``(len(block_ids), block_bytes)``, a
        copy (for a digest over several ranks' pools, block by block)."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
        self._chunks(ids)  # validates the ids
        rows = self.tensor[region].index_select(0, self._index(ids))
        return np.ascontiguousarray(rows.cpu().numpy()).view(np.uint8).reshape(ids.size, -1)

    def scrub(self, block_ids: np.ndarray) -> None:
        """Overwrite these blocks in every region with ``POISON_BYTE``."""
        words = _as_words(self.tensor)
        poison = POISON_BYTE if words is self.tensor else _POISON_WORD
        for _, ids in self._chunks(block_ids):
            words.index_fill_(1, self._index(ids), poison)

    # -- helpers ------------------------------------------------------------------------------

    def _chunks(self, block_ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Validated int64 ids in slices of ``_chunk_blocks``, each with its first position j."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.num_blocks):
            raise ValueError(
                f"block ids out of range 0..{self.cfg.num_blocks - 1}: "
                f"min {ids.min()}, max {ids.max()}"
            )
        step = self._chunk_blocks
        return [(j0, ids[j0 : j0 + step]) for j0 in range(0, ids.size, step)]

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

    def _scratch_view(self, which: int, nblocks: int) -> torch.Tensor:
        """This thread's scratch buffer ``which`` (0 or 1) as a (regions, nblocks, B) tensor."""
        buf: torch.Tensor | None = getattr(self._scratch, "buf", None)
        per_block = self.cfg.bytes_per_block_all_regions
        size = self._chunk_blocks * per_block
        if buf is None:
            buf = torch.empty(2 * size, dtype=torch.uint8, device=self.device)
            self._scratch.buf = buf
        flat = buf[which * size : which * size + nblocks * per_block]
        return flat.view(self.cfg.regions, nblocks, self.cfg.block_bytes)


def _run_start(ids: np.ndarray) -> int | None:
    """First id if ``ids`` are consecutive ascending (one slice covers them), else None."""
    if ids.size == 1 or (ids.size > 1 and bool(np.all(np.diff(ids) == 1))):
        return int(ids[0])
    return None
