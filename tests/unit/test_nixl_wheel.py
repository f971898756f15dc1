"""``kvpush.transport.wheel``: reading a torch build's CUDA from its ``version.py`` without
importing torch, and the wheel picked on this host."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpush.transport.wheel import cuda_in_version_file


@pytest.mark.parametrize(
    ("source", "want"),
    [
        ("from typing import Optional\ncuda: Optional[str] = None\n", "none"),
        ("__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\n", "12.8"),
        ("cuda = '13.0'\nhip = None\n", "13.0"),
        ("hip = None\n", None),  # says nothing about CUDA
        ("cuda = get()\n", None),  # not a constant: not guessed
        ("def (:\n", None),  # not Python
        ("\x00", None),
    ],
)
def test_cuda_of_a_version_file(source: str, want: str | None) -> None:
    assert cuda_in_version_file(source) == want


def test_on_a_cpu_only_torch_the_wheel_is_picked_without_torch() -> None:
    code = (
        "import sys\n"
        "from kvpush.transport.wheel import _torch_cuda_on_disk, nixl_wheel\n"
        "print(_torch_cuda_on_disk(), nixl_wheel(), 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    cuda, wheel, imported = out.stdout.split()
    if cuda != "none":
        pytest.skip(f"this host's torch is not a CPU-only build (cuda {cuda})")
    assert wheel.startswith("nixl_")  # the meta package is bypassed: it would import torch
    assert imported == "False"
