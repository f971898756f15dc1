"""A KV pool's memory on a GPU: one torch allocation in VRAM, moved to and from the host.

Imported only when an endpoint's ``--device`` is ``cuda``/``cuda:N`` (``kvpush.memory.pool``),
so that an endpoint on host memory never imports torch (1-6 s of start-up here). The pattern is
generated and compared on the host (``kvpush.memory.pattern``); this module copies the blocks in
question between the GPU and the host buffers ``KvPool`` hands it. Same threading as the pool:
no lock, called by whichever thread owns the blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpush.errors import ConfigError, DeviceError


def resolve(spec: str) -> int:
    """The CUDA device index of ``cuda`` / ``cuda:N``, else ``DeviceError`` with a hint."""
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
    return index


class DeviceMemory:
    """A zeroed uint8 ``shape`` tensor on torch ``device`` (``cuda:N``; the tests run the same
    path on ``cpu``); blocks in and out by id."""

    kind = "VRAM"

    def __init__(self, shape: tuple[int, int, int], device: str, what: str) -> None:
        self.device = torch.device(device)
        try:
            self.tensor = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate the KV pool: {what}: {exc}",
                hint="lower --num-blocks, --layers or --block-bytes",
            ) from exc
        self.addr = int(self.tensor.data_ptr())
        self.nbytes = int(self.tensor.numel())

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.device)

    def gather(self, region: int | None, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Blocks ``ids`` (of every region, or of one) copied into host ``out``."""
        src = self.tensor if region is None else self.tensor[region]
        axis = 1 if region is None else 0
        out[...] = torch.index_select(src, axis, self._index(ids)).cpu().numpy()
        return out

    def scatter(self, ids: np.ndarray, src: np.ndarray) -> None:
        """Host ``src`` (regions, len(ids), block_bytes) written into blocks ``ids``."""
        self.tensor.index_copy_(1, self._index(ids), torch.from_numpy(src).to(self.device))

    def as_tensor(self) -> torch.Tensor:
        return self.tensor
