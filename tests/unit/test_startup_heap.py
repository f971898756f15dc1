"""``freeze_startup_heap``: the start-up heap frozen, the young generation collected less often.

Run in a child interpreter: the collector's settings are the process's, not this test's to
change.
"""

from __future__ import annotations

import json
import subprocess
import sys

from kvpush.runtime.heap import YOUNG_THRESHOLD

CHILD = """
import gc, json
before = gc.get_threshold()
from kvpush.runtime.heap import freeze_startup_heap
freeze_startup_heap()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def test_an_endpoint_process_freezes_its_start_up_heap_and_collects_young_objects_less_often() -> (
    None
):
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    got = json.loads(out.stdout)
    assert got["frozen"] > 1000, got
    assert got["after"][0] == YOUNG_THRESHOLD > got["before"][0], got
    assert got["after"][1:] == got["before"][1:], got  # the older generations as they were
