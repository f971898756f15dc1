"""``freeze_startup_heap``: keep what a process built at start-up out of later garbage collections.

A started endpoint holds ~170k objects of torch, numpy, typer and its own tables that live as
long as the process. CPython's full (generation 2) collection walks every tracked object with
the interpreter lock held, so each one stalls every thread of the endpoint -- ~0.1 s of CPU
every second or so on a busy D here (``bench rate``), seconds on a starved host. Frozen objects
are never walked again; what is created afterwards is collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then freeze everything alive. Call once a process's
    endpoint is open (``serve-*``, the tests' and the bench's workers); never from a library
    call, whose caller owns the heap."""
    gc.collect()
    gc.freeze()
