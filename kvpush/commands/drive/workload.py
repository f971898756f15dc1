"""``drive --workload``: replay a request trace (Mooncake format), open loop, through the Driver.

Owns ``Replay``, the ``Schedule`` (``kvpush.commands.drive.schedule``) a trace gives the
driver, and the record of the run the report is made of:

* **when**: request k is due ``(timestamp_k - timestamp_first) / 1000 / speedup`` seconds after
  the run starts (the first request replayed -- the first at or after ``--start-at`` -- is due at
  once), whether or not earlier ones have finished: open loop, as long as a worker is free
  (``--concurrency`` workers; a request due while every one is busy starts late, and the report
  says how late). A request that starts within ``LATE_TOLERANCE_S`` of its time is on time;
  the report gives every request's lateness (p50, p99, max) and how many were later than that.
* **how big**: ``ceil(input_length / block_tokens)`` blocks per rank. ``block_tokens`` is
  ``--block-tokens``, else the ``--shape``'s, else ``DEFAULT_BLOCK_TOKENS`` (16, vLLM's
  default page): a pool set up with a flat ``--block-bytes`` has no token size of its own, so a
  block stands for that many tokens.
* **what cannot go**: a request of more blocks than the largest D pool (or P pool) the preflight
  saw -- it could never be allocated -- fails unsent with ``no_free_blocks`` and a line on
  stderr naming its trace line; so does one of more than ``MAX_REQUEST_BLOCKS`` (what one
  request may carry). The replay goes on.
* **what happened**: each result with the time it came (``on_result``), when each request
  started, and D's pool gauges over the run (``kvpush.commands.drive.occupancy.PoolSampler``,
  started when the run starts). ``report`` hands them with drive's own summary to
  ``kvpush.commands.drive.workload_report``.

Threads: ``begin`` on the thread of ``Driver.run``; ``due``, ``started``, ``refuse``, ``blocks``
and ``on_result`` on drive's workers (one lock); ``report`` after the run, on the caller's.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from kvpush.commands.common.results import DriveReport, RequestResult
from kvpush.commands.drive.occupancy import PoolSampler
from kvpush.commands.drive.schedule import Pools
from kvpush.commands.drive.workload_report import Record, WorkloadReport, build
from kvpush.commands.workload.trace import Workload
from kvpush.telemetry.names import Failure

#: Tokens per block when neither --block-tokens nor --shape says (vLLM's default block size).
DEFAULT_BLOCK_TOKENS = 16
#: The most blocks one request may carry (the wire's limit on a request's blocks).
MAX_REQUEST_BLOCKS = 1 << 16
#: A request that starts no later than this after its time is on time.
LATE_TOLERANCE_S = 0.1


class Replay:
    def __init__(
        self,
        workload: Workload,
        block_tokens: int,
        speedup: float,
        on_note: Callable[[str], None],
        token: bytes | None = None,
    ) -> None:
        self.workload = workload
        self.block_tokens = block_tokens
        self.speedup = speedup
        self._on_note = on_note
        self._token = token
        reqs = workload.requests
        first = reqs[0].timestamp_ms
        self._due = [(r.timestamp_ms - first) / 1000.0 / speedup for r in reqs]
        self._blocks = [math.ceil(r.input_length / block_tokens) for r in reqs]
        self._lock = threading.Lock()
        self._late: dict[int, float] = {}
        self._ended: dict[int, tuple[float, RequestResult]] = {}
        self._pools = Pools({}, {})
        self._t0 = 0.0
        self._decodes: Callable[[], list[str]] = list
        self._sampler: PoolSampler | None = None

    @property
    def requests(self) -> int:
        return len(self._due)

    def attach(self, decodes: Callable[[], list[str]]) -> None:
        """The Ds in the rotation now (the driver's), whose pools are sampled."""
        self._decodes = decodes

    # ------------------------------------------------------------------ Schedule
    def begin(self, t0: float, pools: Pools) -> None:
        self._t0, self._pools = t0, pools
        self._sampler = PoolSampler(self._decodes, self._token)
        self._sampler.start()

    def due(self, i: int) -> float | None:
        return self._due[i]

    def started(self, i: int, late_s: float) -> None:
        with self._lock:
            self._late[i] = max(0.0, late_s)

    def blocks(self, i: int) -> int:
        return self._blocks[i]

    def refuse(self, i: int) -> tuple[Failure, str] | None:
        why = self._too_big(self._blocks[i])
        if why is None:
            return None
        r = self.workload.requests[i]
        what = (
            f"a prompt of {r.input_length:,} tokens is {self._blocks[i]:,} blocks of "
            f"{self.block_tokens} tokens, {why}"
        )
        self._on_note(
            f"workload line {r.line}: {what}: counted failed ({Failure.NO_FREE_BLOCKS.value}); "
            "the replay goes on"
        )
        return Failure.NO_FREE_BLOCKS, f"never sent: {what}"

    def _too_big(self, blocks: int) -> str | None:
        if blocks > MAX_REQUEST_BLOCKS:
            return f"more than one request may carry ({MAX_REQUEST_BLOCKS:,})"
        for role, pools in (("D", self._pools.decode), ("P", self._pools.prefill)):
            if pools and blocks > max(pools.values()):
                return f"more than any {role}'s whole pool holds ({max(pools.values()):,} blocks)"
        return None

    # ------------------------------------------------------------------ the record
    def on_result(self, result: RequestResult) -> None:
        with self._lock:
            self._ended[result.index] = (time.monotonic(), result)

    def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()

    def report(self, base: DriveReport, concurrency: int) -> WorkloadReport:
        """The run's report: drive's summary and the replay's own figures."""
        self.stop()
        with self._lock:
            ended = dict(self._ended)
            late = dict(self._late)
        recs = []
        for i, r in enumerate(self.workload.requests):
            t_end, res = ended[i]
            recs.append(
                Record(
                    line=r.line,
                    tokens=r.input_length,
                    blocks=self._blocks[i],
                    due_s=self._due[i],
                    late_s=late.get(i),
                    ended_s=t_end - self._t0,
                    result=res,
                )
            )
        samples = self._sampler.samples if self._sampler is not None else []
        return build(
            base,
            recs,
            [(s.t - self._t0, s.address, s.used, s.total) for s in samples],
            self._pools,
            workload=self.workload,
            block_tokens=self.block_tokens,
            speedup=self.speedup,
            tolerance_s=LATE_TOLERANCE_S,
            concurrency=concurrency,
        )
