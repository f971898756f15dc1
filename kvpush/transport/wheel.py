"""Which NIXL wheel to load, found without importing torch: ``nixl_wheel``.

NIXL 1.5 ships as a meta package (``nixl``) over per-CUDA wheels (``nixl_cu12``, ``nixl_cu13``,
``nixl_rocm``); ``import nixl`` picks one by the process's CUDA. On a host whose torch is a
CPU-only build it imports all of torch just to learn that there is no CUDA: 1-6 s of every
endpoint's start-up here, more than the rest of it. Pure (reads files, imports nothing), any
thread; ``kvpush.transport.nixl`` calls it once per process.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

#: The wheels ``import nixl`` tries, in its order, when the process has no CUDA (nixl 1.5).
_CPU_WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def cuda_in_version_file(source: str) -> str | None:
    """The ``cuda = ...`` of a torch ``version.py``'s text (parsed, never run): the CUDA
    version, ``"none"`` for a CPU-only build, None when the text says neither."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        target: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(value, ast.Constant):
            return str(value.value).lower() if value.value is not None else "none"
    return None


def _torch_cuda_on_disk() -> str | None:
    """``torch.version.cuda`` of the installed torch, read without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        return cuda_in_version_file(Path(spec.origin).with_name("version.py").read_text())
    except OSError:
        return None


def nixl_wheel() -> str:
    """The module whose ``_api`` / ``_bindings`` to load: on a CPU-only torch (and only
    there) the wheel the meta package would pick, in its order; anywhere else (torch already
    imported, a CUDA torch, no torch: the meta package's choice is cheap) ``nixl`` itself."""
    if "torch" in sys.modules or _torch_cuda_on_disk() != "none":
        return "nixl"
    for name in _CPU_WHEELS:
        if importlib.util.find_spec(name) is not None:
            return name
    return "nixl"
