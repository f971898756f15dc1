"""The layer contracts of pyproject.toml hold: ``lint-imports`` as a real subprocess.

Layers, top to bottom: cli -> commands (bench -> demo | fleet -> drive -> probe | leg | serve
-> common) -> fleet -> endpoint -> prefill | decode -> runtime ->
peers | memory -> transport -> wire | telemetry -> errors : config; only kvpush.transport
imports nixl and zmq. The second test runs the same tool on a contract that the tree breaks,
so that a runner which passes whatever it is given would be caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT, "--no-cache", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )


def test_layer_contracts_are_kept() -> None:
    r = _lint()
    assert r.returncode == 0, r.stdout + r.stderr
    n = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {n} kept, 0 broken." in r.stdout


def test_a_broken_contract_fails(tmp_path: Path) -> None:
    cfg = tmp_path / "upside-down.toml"
    cfg.write_text(
        '[tool.importlinter]\nroot_packages = ["kvpush"]\n\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "upside down"\ntype = "layers"\nlayers = ["kvpush.config", "kvpush.cli"]\n'
    )
    r = _lint("--config", str(cfg))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "upside down BROKEN" in r.stdout
    assert "kvpush.cli is not allowed to import kvpush.config" in r.stdout
