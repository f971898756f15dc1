"""The registered KV memory of one endpoint: one allocation, fill / verify / digest.

``KvPool`` owns the one allocation that the NIXL adapter registers, its ``BlockAllocator``
(``kvpush.memory.allocator``) and ``fill`` / ``verify`` / ``digest`` of blocks. Host memory
(DRAM, ``--device cpu``) is a numpy array; a pool on a GPU (VRAM) is a torch tensor
(``kvpush.memory.vram``, the only importer of torch on an endpoint's path: an endpoint on host
memory starts without torch, 1-6 s sooner here). The pattern is generated and compared on the
host either way. These take no lock: they are called by whichever thread currently owns the
blocks in question (the allocator says who that is). Never imports nixl or zmq.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvpush.config import PoolConfig
from kvpush.errors import ConfigError
from kvpush.memory.allocator import BlockAllocator
from kvpush.memory.descriptors import block_descs
from kvpush.memory.pattern import TAG_BYTES, read_tag, transfer_digest, write_expected
from kvpush.wire.side_messages import DeviceKind

if TYPE_CHECKING:
    import torch

_CHUNK_BYTES = 16 * 1024 * 1024  # fill/verify/digest work in slices of this size (scratch x 2)


def rank_device(spec: str, rank: int) -> str:
    """Where rank ``rank`` keeps its pool: ``cuda`` -> ``cuda:rank``, ``cuda:N`` ->
    ``cuda:N+rank`` (one GPU per rank, as vLLM's workers), ``cpu`` -> ``cpu``."""
    if spec == "cpu" or not spec.startswith("cuda") or (rank == 0 and spec == "cuda"):
        return spec
    base = int(spec.partition(":")[2]) if ":" in spec else 0
    return f"cuda:{base + rank}"


def _resolve_device(spec: str) -> tuple[str, DeviceKind, int]:
    """``cpu`` / ``cuda`` / ``cuda:N`` -> (device name, "DRAM" | "VRAM", device id)."""
    if spec == "cpu":
        return "cpu", "DRAM", 0
    from kvpush.memory import vram  # torch: only for a pool on a GPU

    index = vram.resolve(spec)
    return f"cuda:{index}", "VRAM", index


def check_device(spec: str) -> str:
    """``DRAM`` or ``VRAM`` for a device spec usable here, else ``DeviceError`` (the same
    error and hint an endpoint gives), for commands that check before starting processes."""
    return _resolve_device(spec)[1]


def _as_words(a: np.ndarray) -> np.ndarray:
    """uint8 blocks as int64 words when the block size allows it (same bytes; numpy's fancy
    indexing and comparisons move ~8x more per element)."""
    return a.view(np.int64) if a.shape[-1] % 8 == 0 else a


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(_as_words(a), _as_words(b)))


class _Memory(Protocol):
    """Where a pool's bytes live: blocks in and out by id (host arrays in, host arrays out)."""

    kind: str
    addr: int
    nbytes: int

    def gather(self, region: int | None, ids: np.ndarray, out: np.ndarray) -> np.ndarray: ...
    def scatter(self, ids: np.ndarray, src: np.ndarray) -> None: ...
    def as_tensor(self) -> torch.Tensor: ...


class HostMemory:
    """A zeroed uint8 ``shape`` numpy array in DRAM (``np.zeros`` + a write to every page, so
    an over-committed host fails at start-up with a clear error, not at the first transfer)."""

    kind = "DRAM"

    def __init__(self, shape: tuple[int, int, int], what: str) -> None:
        try:
            self.array = np.zeros(shape, dtype=np.uint8)
            self.array.fill(0)  # np.zeros maps lazily: touch every page now
        except (MemoryError, ValueError) as exc:
            raise ConfigError(
                f"cannot allocate the KV pool: {what}: {exc}",
                hint="lower --num-blocks, --layers or --block-bytes",
            ) from exc
        self.addr = int(self.array.ctypes.data)
        self.nbytes = int(self.array.nbytes)

    def gather(self, region: int | None, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        src = self.array if region is None else self.array[region]
        # mode="clip": no bounds buffer (the pool validated the ids), straight into ``out``.
        np.take(
            _as_words(src), ids, axis=1 if region is None else 0, out=_as_words(out), mode="clip"
        )
        return out

    def scatter(self, ids: np.ndarray, src: np.ndarray) -> None:
        _as_words(self.array)[:, ids] = _as_words(src)

    def as_tensor(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.array)


class KvPool:
    """One registered allocation per endpoint: uint8 ``(regions, num_blocks, block_bytes)``.

    Region ``r`` starts at ``base_addr + r*region_stride``; block ``b`` of it at
    ``+ b*block_bytes``. ``fill`` / ``verify`` / ``digest`` work on slices of at most ~16 MiB (or
    one block in every region, if larger); in host memory a run of consecutive ids is read and
    written in place, other ids (and a GPU's blocks) go through one reusable scratch buffer per
    calling thread, so they allocate nothing after the first call and run at several GB/s.
    """

    def __init__(self, cfg: PoolConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        # The model heads this rank's pages hold (all of them when replicated).
        self._pat = {"heads": cfg.heads_per_rank, "first_head": cfg.first_head(rank)}
        self.device, self.device_kind, self.device_id = _resolve_device(
            rank_device(cfg.device, rank)
        )
        shape = (cfg.regions, cfg.num_blocks, cfg.block_bytes)
        what = f"{cfg.total_bytes} bytes ({cfg.total_bytes / 2**30:.2f} GiB) on {cfg.device}"
        self.memory: _Memory
        self.host: np.ndarray | None = None  # the pool itself when it is in host memory
        if self.device_kind == "DRAM":
            host = HostMemory(shape, what)
            self.memory, self.host = host, host.array
        else:
            from kvpush.memory import vram

            self.memory = vram.DeviceMemory(shape, self.device, what)
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.base_addr: int = self.memory.addr
        self.nbytes: int = self.memory.nbytes
        self.region_stride: int = cfg.num_blocks * cfg.block_bytes
        self._chunk_blocks = max(1, _CHUNK_BYTES // cfg.bytes_per_block_all_regions)
        self._scratch = threading.local()

    def as_tensor(self) -> torch.Tensor:
        """The pool as a torch tensor (the same memory; imports torch): for the bench."""
        return self.memory.as_tensor()

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
            if start is not None and self.host is not None:
                write_expected(
                    self.host[:, start : start + ids.size], transfer_id, first_j=j0, **self._pat
                )
                continue
            exp = write_expected(
                self._scratch_view(0, ids.size), transfer_id, first_j=j0, **self._pat
            )
            self.memory.scatter(ids, exp)

    def verify(self, transfer_id: str, block_ids: np.ndarray) -> bool:
        """True iff every byte of these blocks, in every region, equals the pattern."""
        for j0, ids in self._chunks(block_ids):
            exp = write_expected(
                self._scratch_view(0, ids.size), transfer_id, first_j=j0, **self._pat
            )
            if not _equal(self._blocks(ids), exp):
                return False
        return True

    def page(self, region: int, block: int) -> np.ndarray:
        """The bytes of one block of one region (a view in host memory, else a copy)."""
        if self.host is not None:
            row: np.ndarray = self.host[region, block]
            return row
        ids = np.array([block], dtype=np.int64)
        copied: np.ndarray = self.memory.gather(None, ids, self._scratch_view(1, 1))[region, 0]
        return copied

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
            ).reshape(self.cfg.regions, heads, hb)
            got = self._blocks(np.array([b], dtype=np.int64)).reshape(self.cfg.regions, heads, hb)
            for r in range(self.cfg.regions):
                for h in range(heads):
                    if _equal(got[r, h], exp[r, h]):
                        continue
                    where = (
                        f"rank {self.rank}, region {r}, block {b} (position {j}), head {first + h}"
                    )
                    if hb < TAG_BYTES:
                        return f"{where}: bytes differ"
                    digest, fr, fh, fj = read_tag(got[r, h])
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
                h.update(self._region_rows(r, part).data)
        return h.hexdigest()

    def region_rows(self, region: int, block_ids: np.ndarray) -> np.ndarray:
        """The bytes of these blocks of one region: uint8 ``(len(block_ids), block_bytes)``, a
        copy (for a digest over several ranks' pools, block by block)."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
        self._chunks(ids)  # validates the ids
        return self._region_rows(region, ids)

    # -- helpers ------------------------------------------------------------------------------

    def _blocks(self, ids: np.ndarray) -> np.ndarray:
        """These (validated) blocks of every region: in place for a host run, else copied into
        this thread's second scratch buffer."""
        start = _run_start(ids)
        if start is not None and self.host is not None:
            return self.host[:, start : start + ids.size]
        return self.memory.gather(None, ids, self._scratch_view(1, ids.size))

    def _region_rows(self, region: int, ids: np.ndarray) -> np.ndarray:
        out = np.empty((ids.size, self.cfg.block_bytes), dtype=np.uint8)
        return self.memory.gather(region, ids, out)

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

    def _scratch_view(self, which: int, nblocks: int) -> np.ndarray:
        """This thread's host scratch buffer ``which`` (0 or 1) as a (regions, nblocks, B) array."""
        buf: np.ndarray | None = getattr(self._scratch, "buf", None)
        per_block = self.cfg.bytes_per_block_all_regions
        size = self._chunk_blocks * per_block
        if buf is None:
            buf = np.empty(2 * size, dtype=np.uint8)
            self._scratch.buf = buf
        flat = buf[which * size : which * size + nblocks * per_block]
        return flat.reshape(self.cfg.regions, nblocks, self.cfg.block_bytes)


def _run_start(ids: np.ndarray) -> int | None:
    """First id if ``ids`` are consecutive ascending (one slice covers them), else None."""
    if ids.size == 1 or (ids.size > 1 and bool(np.all(np.diff(ids) == 1))):
        return int(ids[0])
    return None
