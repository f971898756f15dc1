"""Drive's per-P executor (``Senders``): a call stuck at a dead peer holds a thread until its
deadline; ``grow`` adds one so the next prefill leg does not queue behind it."""

from __future__ import annotations

import threading

from kvpush.commands.drive.senders import Senders


def test_a_grown_executor_runs_the_next_call_beside_a_stuck_one() -> None:
    ex = Senders(1, "t-senders")
    stuck, release = threading.Event(), threading.Event()
    ran = threading.Event()

    def hold() -> None:
        stuck.set()
        release.wait(30)

    try:
        held = ex.submit(hold)
        assert stuck.wait(10)
        nxt = ex.submit(ran.set)
        assert not ran.wait(0.3)  # one thread, and it is stuck: the call queues
        ex.grow(1)
        assert ran.wait(10)  # the added thread takes it
        nxt.result(10)
    finally:
        release.set()
        held.result(10)
        ex.close()
