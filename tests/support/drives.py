"""``kvpush drive`` as a child process, for the suites that follow a registry while it runs.

``start_drive`` launches ``drive --json`` with the given arguments (the registry's among them);
``finish_drive`` waits for it (killing it on a timeout), and returns its JSON report and stderr.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.support.procs import KVPUSH, clean_env


def start_drive(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KVPUSH, "drive", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )


def finish_drive(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[dict[str, Any], str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert out.strip(), err
    rep: dict[str, Any] = json.loads(out)
    return rep, err
