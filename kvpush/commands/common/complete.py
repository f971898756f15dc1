"""Tab-completion values of the options whose values are names kvpush knows but no enum holds:
``--shape``, ``--dtype`` and ``--device`` (``bench``'s scenario is the bench command's own).

Each function is a typer ``autocompletion`` callback: it gets the word typed so far and returns
the values that start with it. They run on every Tab press (typer re-runs ``kvpush``), so each
imports only light modules, inside the function, and reads the GPUs from ``/proc`` rather than
asking torch. Main thread.
"""

from __future__ import annotations

import os

#: Where the NVIDIA driver lists one directory per GPU (no torch, no CUDA needed to read it).
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def starting(values: list[str], incomplete: str) -> list[str]:
    return [v for v in values if v.startswith(incomplete)]


def shapes(incomplete: str) -> list[str]:
    from kvpush.memory.shapes import SHAPES

    return starting(list(SHAPES), incomplete)


def dtypes(incomplete: str) -> list[str]:
    from kvpush.config import DTYPE_SIZES

    return starting(sorted(DTYPE_SIZES), incomplete)


def devices(incomplete: str) -> list[str]:
    """``cpu``, ``cuda`` and ``cuda:N`` for each GPU the driver lists on this host."""
    try:
        n = len(os.listdir(NVIDIA_GPUS))
    except OSError:
        n = 0
    return starting(["cpu", "cuda", *(f"cuda:{i}" for i in range(n))], incomplete)
