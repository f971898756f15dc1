"""How many side-channel sockets and threads one drive may hold: its budget, planned up front.

Owns ``plan_sockets`` and the numbers it plans with. ZMQ holds at most 1023 sockets per
process: a socket per worker, prefill-leg sockets never more than the requests in flight need,
and a fixed reserve (the monitor's clients of busy peers, the registry's checks, replacement
workers) -- the number of peers costs nothing, only peers with work in flight hold a socket.
Pure; any thread.
"""

from __future__ import annotations

from kvpush.commands.drive.health import MONITOR_CLIENTS
from kvpush.commands.drive.preflight import CHECK_THREADS

#: Side-channel sockets one drive may open (ZMQ's default limit is 1023 per process).
SOCKET_BUDGET = 1000
#: Threads (and sockets) per prefill endpoint for prefill legs.
PREFILL_THREADS = 16
#: Workers replaced after their peer died under them (each keeps its socket until its deadline).
REPLACEMENT_RESERVE = 20
#: Sockets kept spare beyond every planned one.
SPARE_SOCKETS = 8


def plan_sockets(want: int, n_prefill: int, p_threads: int) -> tuple[int, int]:
    """(workers, prefill-leg sockets) within ``SOCKET_BUDGET``. Each worker holds one D socket;
    prefill legs hold one each, and there are never more of them than requests in flight (one
    per worker), plus one executor's worth for the trace's questions to P -- nor more than the
    Ps' executor threads. The rest is a fixed reserve: the monitor's clients of busy peers,
    the registry's checks, replacement workers. How many peers there are costs nothing."""
    room = SOCKET_BUDGET - SPARE_SOCKETS - REPLACEMENT_RESERVE - MONITOR_CLIENTS - CHECK_THREADS
    threads = p_threads * max(1, n_prefill)
    # w + min(threads, w + p_threads) <= room: either term of the min may be the one that fits.
    workers = max(1, min(want, max(room - threads, (room - p_threads) // 2)))
    return workers, min(threads, workers + p_threads)
