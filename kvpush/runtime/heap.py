"""``freeze_startup_heap``: keep what a process built at start-up out of later garbage collections,
and collect the young generation less often.

A started endpoint holds ~170k objects of torch, numpy, typer and its own tables that live as
long as the process. CPython's full (generation 2) collection walks every tracked object with
the interpreter lock held, so each one stalls every thread of the endpoint -- ~0.1 s of CPU
every second or so on a busy D here (``bench rate``), seconds on a starved host. Frozen objects
are never walked again; what is created afterwards is collected as before.

The young generation: CPython collects it each time 700 more container objects were made than
freed, and each collection walks every young object still alive -- on a busy endpoint the
pushes in flight, again and again. A 1-block push makes a few dozen objects that reference
counting frees (the hot path makes no cycles: ``gc.DEBUG_SAVEALL`` finds none), so that walking
is nearly all waste. ``bench rate``, 64 in flight, timed with ``gc.callbacks``: ~900 young and
~80 middle collections per 60,000 pushes in P, 5.0 us of P's CPU a push and 8.0 of D's (whose
load generator keeps every request's result). ``YOUNG_THRESHOLD`` makes them ~12 times rarer:
0.6 and 4.0 us; each then walks at most that many objects (a millisecond or two), and cyclic
garbage waits that much longer to be found. What keeps ended work alive for a while counts
against the threshold too: the deadline heaps' stale entries are bounded well below it
(``kvpush.runtime.timers.TRIM_SLACK``), and a steady load then makes no young collection at all.
"""

from __future__ import annotations

import gc

#: Net new container objects between two young-generation collections (CPython's default: 700).
YOUNG_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, freeze everything alive, and set the young
    generation's threshold to ``YOUNG_THRESHOLD``. Call once a process's endpoint is open
    (``serve-*``, the tests' and the bench's workers); never from a library call, whose caller
    owns the heap."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
