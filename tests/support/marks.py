"""``skip_unless_marker_selected``: a long test runs only when the run selected its marker."""

from __future__ import annotations

import os
from typing import Any


def skip_unless_marker_selected(request: Any, marker: str) -> None:
    """Skip a long test unless the run selected its marker (``-m slow``): the default run stays
    short even where the pytest configuration does not deselect it."""
    import pytest

    expr = str(request.config.getoption("markexpr") or "")
    if os.environ.get("KVPUSH_RUN_SLOW") == "1":
        return
    if marker not in expr.replace(f"not {marker}", ""):
        pytest.skip(f"{marker} test: run with -m {marker} (or KVPUSH_RUN_SLOW=1)")
