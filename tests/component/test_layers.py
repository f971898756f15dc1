"""The layer contracts of pyproject.toml hold: ``lint-imports`` as a real subprocess.

Layers, top to bottom: cli -> commands (bench -> demo | fleet -> drive -> probe | leg | serve
-> common) -> fleet -> endpoint -> prefill | decode -> runtime ->
peers | memory -> transport -> wire | telemetry -> errors : config; only kvpush.transport
imports nixl and zmq. The second test runs the same tool on a contract that the tree breaks,
so that a runner which passes whatever it is given would be caught.
"""

from __future__ import annotations

import os
import shutil
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


def test_a_shared_module_importing_a_command_breaks_the_layers(tmp_path: Path) -> None:
    """The real layer contract on a copy of the package whose common folder imports drive."""
    shutil.copytree(
        ROOT / "kvpush", tmp_path / "kvpush", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    mod = tmp_path / "kvpush" / "commands" / "common" / "stats.py"
    mod.write_text(
        mod.read_text() + "\nfrom kvpush.commands.drive import driver  # noqa: E402, F401\n"
    )
    r = subprocess.run(
        [LINT, "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "kvpush layers: cli -> bench" in r.stdout
    assert "BROKEN" in r.stdout
    assert "kvpush.commands.common.stats -> kvpush.commands.drive.driver" in r.stdout
