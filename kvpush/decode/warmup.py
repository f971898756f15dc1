"""D's own request path, run once before its first request (``serve-decode --prewarm``).

Owns ``warm_request_path``. ``--prewarm`` takes the handshakes out of a pair's first request
(``kvpush.fleet.prewarm``), but a new D's first request still paid first-call costs of its own:
its verification step took 13-21 ms there and ~1 ms after (``drive --trace``'s ``verified``
phase), because everything it uses is made at first use -- the completer's thread, the
pattern's base row (``kvpush.memory.pattern.base_row``: generated and cached per block size),
numpy's and torch's first calls of the compare and index kernels, the completer thread's scratch
buffers (``KvPool``'s per-thread scratch), ``hashlib``'s first digest.

``warm_request_path`` runs the completer's reads once, on the completer's own thread: a
verification of a run of blocks and of a scattered pair (the two ways ``KvPool.verify`` reads),
and a digest (what a ``--digest`` or vLLM-wire request adds). It only reads the pool: no block is
allocated or written, no counter moves, and the verdict is thrown away (the blocks hold no
transfer yet). It runs while the rank starts (``DecodeRole.start``), before the endpoint is
ready and registered, so no request can find the path cold; it is bounded by ``WAIT_S`` and a
failure or a timeout is logged and the endpoint starts all the same (the warm-up is an
optimisation, never a condition). The result is logged and kept in the rank's telemetry info
(``warmup``: ``request path`` once done).

Threads: ``warm_request_path`` on the thread that starts the rank; the reads on the completer's.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from kvpush.memory.pool import KvPool
from kvpush.telemetry.store import Telemetry

log = logging.getLogger(__name__)

#: How long a rank's start waits for its warm-up (seconds): far more than it takes (tens of ms
#: for small blocks; a verification of one block in every region for large ones).
WAIT_S = 30.0
#: The transfer id the warm-up's throwaway verification is computed for.
WARMUP_TRANSFER = "kvpush-warmup"
#: What the rank's telemetry info says once the warm-up ran.
WARMED = "request path"


def warm_reads(pool: KvPool) -> float:
    """Read the pool the way a request's completion does (the completer's thread): verify a run
    of blocks and a scattered pair, digest one block. Seconds taken."""
    t0 = time.perf_counter()
    n = pool.cfg.num_blocks
    run = np.arange(min(2, n), dtype=np.int64)  # consecutive: read in place
    scattered = np.array([n - 1, 0], dtype=np.int64)  # not a run: gathered into scratch
    pool.verify(WARMUP_TRANSFER, run)
    pool.verify(WARMUP_TRANSFER, scattered)
    pool.digest(run[:1])
    return time.perf_counter() - t0


def warm_request_path(pool: KvPool, completer: Executor, telemetry: Telemetry, rank: int) -> bool:
    """Run ``warm_reads`` on ``completer`` (the completer's executor) and wait for it (at most
    ``WAIT_S``); say how it went. True when it ran."""
    t0 = time.perf_counter()
    try:
        took = completer.submit(warm_reads, pool).result(WAIT_S)
    except FutureTimeout:
        log.warning(
            "decode rank %d: warming the request path took more than %gs; starting without "
            "waiting for it",
            rank,
            WAIT_S,
        )
        return False
    except Exception as e:  # an optimisation only: the endpoint starts all the same
        log.warning("decode rank %d: warming the request path failed: %s", rank, e)
        return False
    telemetry.info(warmup=WARMED)
    log.info(
        "decode rank %d: request path warmed before ready (verification and digest on the "
        "completer thread) in %.1f ms (%.1f ms of reads)",
        rank,
        (time.perf_counter() - t0) * 1e3,
        took * 1e3,
    )
    return True
