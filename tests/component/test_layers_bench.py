"""The bench's ``forbidden`` contract of pyproject.toml can fail: ``lint-imports`` as a real
subprocess, on a copy of the package whose bench module is made to break it.

The contract (read from pyproject.toml, not restated here) lets ``kvpush.commands.bench`` drive
endpoints only through ``kvpush.endpoint``'s public face (``open_endpoint`` and the endpoint's own
verbs); the copy proves it is kept with that face, broken by an import of the writer's record (what
``bench/loadgen.py`` did before), and broken by an import of one of the endpoint's own modules
(``kvpush.endpoint.core``: the face is the package, nothing below it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
LINT = str(Path(sys.executable).with_name("lint-imports"))
NAME = "the bench drives endpoints only through kvpush.endpoint's public face"


def _contract() -> dict[str, Any]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (c,) = [c for c in cfg["tool"]["importlinter"]["contracts"] if c["name"] == NAME]
    return dict(c)


def _toml(contract: dict[str, Any]) -> str:
    lines = ['[tool.importlinter]\nroot_packages = ["kvpush"]\n', "[[tool.importlinter.contracts]]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in contract.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package and of the contract, to break on purpose."""
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "kvpush", root / "kvpush", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "contract.toml").write_text(_toml(_contract()))
    return root


def _lint(root: Path, extra: str) -> subprocess.CompletedProcess[str]:
    """Lint the copy with ``extra`` appended to its bench load generator."""
    mod = root / "kvpush" / "commands" / "bench" / "loadgen.py"
    original = (ROOT / "kvpush" / "commands" / "bench" / "loadgen.py").read_text()
    mod.write_text(original + extra)
    return subprocess.run(
        [LINT, "--no-cache", "--config", str(root / "contract.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(root)},
    )


@pytest.mark.timeout(300)
def test_the_contract_is_kept_through_the_public_face(tree: Path) -> None:
    r = _lint(tree, "\nfrom kvpush.endpoint import open_endpoint  # noqa: E402, F401\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{NAME} KEPT" in r.stdout


@pytest.mark.timeout(300)
def test_a_bench_import_of_the_writer_record_breaks_it(tree: Path) -> None:
    r = _lint(tree, "\nfrom kvpush.prefill.table import Finished  # noqa: E402, F401\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{NAME} BROKEN" in r.stdout
    assert "kvpush.commands.bench.loadgen -> kvpush.prefill.table" in r.stdout


@pytest.mark.timeout(300)
def test_an_endpoint_module_below_the_face_breaks_it(tree: Path) -> None:
    r = _lint(tree, "\nfrom kvpush.endpoint.core import Endpoint  # noqa: E402, F401\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{NAME} BROKEN" in r.stdout
    assert "kvpush.commands.bench.loadgen -> kvpush.endpoint.core" in r.stdout


OUTSIDE = "nothing but the CLI shell imports the bench"


@pytest.mark.timeout(300)
def test_a_command_that_imports_the_bench_breaks_it(tmp_path: Path) -> None:
    """The other forbidden contract: drive (below the bench) importing a bench module."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (c,) = [c for c in cfg["tool"]["importlinter"]["contracts"] if c["name"] == OUTSIDE]
    shutil.copytree(
        ROOT / "kvpush", tmp_path / "kvpush", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "contract.toml").write_text(_toml(dict(c)))
    mod = tmp_path / "kvpush" / "commands" / "drive" / "driver.py"
    mod.write_text(
        mod.read_text() + "\nfrom kvpush.commands.bench import report  # noqa: E402, F401\n"
    )
    r = subprocess.run(
        [LINT, "--no-cache", "--config", str(tmp_path / "contract.toml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{OUTSIDE} BROKEN" in r.stdout
    assert "kvpush.commands.drive.driver -> kvpush.commands.bench.report" in r.stdout
