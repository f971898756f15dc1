"""``drive --workload``: each D's pool occupancy over the run, in the D's own words.

Owns ``PoolSampler``: a daemon thread (``drive-pools``) that asks every D in the rotation for
its telemetry snapshot (``StatsReq``) every ``SAMPLE_S`` and keeps ``Sample`` s of its pool
gauges: ``pool_total`` and ``pool_free`` (the D's allocator: blocks held by a request, in flight
or quarantined are not free), per rank (a TP endpoint's gauges add its ranks up). A D that does
not answer within ``ASK_S`` is passed over for that round (no sample, never a guess). What it
misses between two samples it misses: drive's own count of the blocks in flight
(``kvpush.commands.drive.workload_report``) is exact from drive's side.

Threads: its own (one side-channel client per D, made and closed there); ``samples`` is read
once ``stop`` has joined it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.commands.common import control
from kvpush.errors import KvpushError
from kvpush.wire import protocol

if TYPE_CHECKING:
    from kvpush.transport.client import SideChannelClient

log = logging.getLogger(__name__)

#: How often each D is asked (seconds).
SAMPLE_S = 0.1
#: How long one D's answer may take before that round passes it over.
ASK_S = 1.0


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic() when the answer came
    address: str
    used: int  # blocks not free, per rank
    total: int  # the pool, per rank


def pool_sample(address: str, snapshot: dict[str, object], t: float) -> Sample | None:
    """The pool gauges of one snapshot, per rank (None: it has none)."""
    gauges = snapshot.get("gauges")
    info = snapshot.get("info")
    if not isinstance(gauges, dict):
        return None
    total, free = gauges.get("pool_total"), gauges.get("pool_free")
    if not isinstance(total, int | float) or not isinstance(free, int | float) or total <= 0:
        return None
    tp = info.get("tp_size", 1) if isinstance(info, dict) else 1
    ranks = tp if isinstance(tp, int) and tp > 0 else 1
    return Sample(t, address, int(total - free) // ranks, int(total) // ranks)


class PoolSampler:
    def __init__(
        self, decodes: Callable[[], list[str]], token: bytes | None, interval_s: float = SAMPLE_S
    ) -> None:
        self._decodes = decodes
        self._token = token
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples: list[Sample] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="drive-pools", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(ASK_S + 2.0)

    def _run(self) -> None:
        clients: dict[str, SideChannelClient] = {}
        try:
            while not self._stop.is_set():
                for d in self._decodes():
                    self._ask(clients, d)
                self._stop.wait(self._interval_s)
        except Exception:  # the samples stop; the run goes on
            log.exception("drive: the pool sampler failed")
        finally:
            for c in clients.values():
                c.close()

    def _ask(self, clients: dict[str, SideChannelClient], d: str) -> None:
        c = clients.get(d)
        if c is None:
            c = clients[d] = control.connect(d, self._token, ASK_S)
        try:
            rep = control.call(c, protocol.StatsReq(), ASK_S)
        except KvpushError:
            return  # no answer this round (the client closed its socket: a fresh one next)
        if isinstance(rep, protocol.StatsRep):
            s = pool_sample(d, rep.snapshot, time.monotonic())
            if s is not None:
                self.samples.append(s)
