"""P's role: fill blocks for a transfer and push them with the writer.

One ``PrefillRole`` per tensor-parallel rank. ``reserve`` + ``fill`` + ``finish`` stand in for
the model: allocate this rank's blocks, write its share of the transfer's deterministic pattern
(its heads) into them and hand them to the writer as *finished*; the writer
(``kvpush.prefill.writer``, on this rank's owner thread) does everything else.
``watch(transfer_id)`` resolves when that transfer's push ends on this rank (WRITE done, failed,
or lease lapsed); the last few thousand outcomes are kept for a wait that comes late. Side-channel
requests are served for all ranks at once by ``kvpush.prefill.group``, which asks the role, never
its writer: ``declines_held``, ``declined_by_d`` and ``refused_by_p`` hand the writer what it
must do on its own thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import numpy as np

from kvpush.config import Role
from kvpush.errors import KvpushError, NoFreeBlocksError, ShuttingDownError
from kvpush.peers.handshakes import PeerGone
from kvpush.prefill.table import CancelledEarly, Finished, PushOutcome
from kvpush.prefill.writer import PushWriter
from kvpush.runtime.context import EndpointContext
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry.names import Counter, Failure

log = logging.getLogger(__name__)


class PrefillRole:
    name = Role.PREFILL

    def __init__(self, ctx: EndpointContext) -> None:
        self.ctx = ctx
        self.owner = OwnerThread("push-writer", ctx.cfg.agent)
        self.writer = PushWriter(ctx, self.owner, on_outcome=self._outcome)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watches: dict[str, Future[PushOutcome]] = {}
        self._waiters: dict[str, int] = {}  # waits per watched transfer
        self._recent: OrderedDict[str, PushOutcome] = OrderedDict()

    # ------------------------------------------------------------------ RoleWorker
    def start(self) -> None:
        self.owner.start()

    def stop_intake(self, drain_s: float) -> None:
        self._stopping.set()

    def stop(self, drain_s: float) -> None:
        self.owner.stop(drain_s)

    def failure(self) -> BaseException | None:
        return self.owner.failure

    def poke(self) -> None:
        self.owner.wake.set()

    def forget_peer(self, gone: PeerGone) -> None:
        self.writer.forget(gone)

    # ------------------------------------------------------------------ API (any thread)
    def reserve(self, transfer_id: str, num_blocks: int) -> np.ndarray:
        """Allocate this rank's blocks for ``transfer_id`` (all or nothing)."""
        if self._stopping.is_set():
            raise ShuttingDownError("prefill endpoint is shutting down")
        if not transfer_id:
            raise KvpushError("transfer id is empty", "pass a non-empty transfer id")
        try:
            return self.ctx.pool.allocator.allocate(self.key(transfer_id), num_blocks)
        except NoFreeBlocksError:
            self.ctx.telemetry.fail(Failure.NO_FREE_BLOCKS)
            raise
        except ValueError as e:
            raise KvpushError(f"cannot prefill {transfer_id}: {e}") from None

    def unreserve(self, transfer_id: str) -> None:
        self.ctx.pool.allocator.release(self.key(transfer_id))

    def fill(self, transfer_id: str, ids: np.ndarray) -> None:
        """This rank's share of the transfer's pattern into reserved blocks."""
        self.ctx.pool.fill(transfer_id, ids)

    def finish(self, transfer_id: str, ids: np.ndarray, request_id: str = "") -> None:
        """Hand filled blocks to the writer as finished (released again if that fails)."""
        key = self.key(transfer_id)
        try:
            rid = request_id or transfer_id
            self.writer.finished.put(Finished(key, transfer_id, rid, ids, time.monotonic()))
        except BaseException:
            self.ctx.pool.allocator.release(key)
            raise
        self.ctx.telemetry.inc(Counter.PREFILLS)

    def key(self, transfer_id: str) -> str:
        """The writer's table key, which also owns the blocks."""
        return self.ctx.dialect.transfer_key(transfer_id)

    # ------------------------------------------------------------------ declines (any thread)
    def declines_held(self) -> int:
        """How many transfers declined by D the writer remembers (read off its thread: a little
        stale)."""
        return self.writer.table.count(CancelledEarly)

    def declined_by_d(
        self, tids: list[str], reason: str, detail: str, then: Callable[[], None]
    ) -> None:
        """D declined these transfers: the writer ends them on its thread, then runs ``then``
        there. Raises ``KvpushError`` when its inbox is closed or full (nothing was handed)."""
        self.writer.tasks.put(functools.partial(self._declined, tids, reason, detail, then))

    def _declined(
        self, tids: list[str], reason: str, detail: str, then: Callable[[], None]
    ) -> None:
        try:
            for tid in tids:
                self.writer.declined_by_d(tid, reason, detail)
        finally:
            then()

    def refused_by_p(self, transfer_id: str, reason: str, detail: str) -> None:
        """P will not serve ``transfer_id``: the writer tells the D ranks that registered for it,
        or will (raises ``KvpushError`` when its inbox is closed: the rank is stopping)."""
        self.writer.tasks.put(
            functools.partial(self.writer.refused_by_p, transfer_id, reason, detail)
        )

    # ------------------------------------------------------------------ outcomes
    def watch(self, transfer_id: str) -> Future[PushOutcome]:
        """A future resolved with the push outcome of ``transfer_id`` (at once if it ended)."""
        with self._lock:
            done = self._recent.get(transfer_id)
            if done is not None:
                fut: Future[PushOutcome] = Future()
                fut.set_result(done)
                return fut
            self._waiters[transfer_id] = self._waiters.get(transfer_id, 0) + 1
            return self._watches.setdefault(transfer_id, Future())

    def unwatch(self, transfer_id: str) -> None:
        """A wait for ``transfer_id`` gave up: forget its future once nobody waits (a wait for
        a transfer that never comes would otherwise stay here for good)."""
        with self._lock:
            n = self._waiters.get(transfer_id, 0) - 1
            if n > 0:
                self._waiters[transfer_id] = n
                return
            self._waiters.pop(transfer_id, None)
            fut = self._watches.get(transfer_id)
            if fut is not None and not fut.done():
                del self._watches[transfer_id]

    def _outcome(self, outcome: PushOutcome) -> None:
        """Writer thread: remember the outcome, resolve whoever waits for it."""
        with self._lock:
            _remember(self._recent, outcome.transfer_id, outcome)
            fut = self._watches.pop(outcome.transfer_id, None)
            self._waiters.pop(outcome.transfer_id, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    def kv_transfer_params(
        self, request_id: str, block_ids: list[int]
    ) -> dict[str, str | int | bool | list[list[int]]]:
        """What a vLLM P's ``request_finished`` returns for the router to hand to D."""
        md = self.ctx.metadata
        return {
            "remote_block_ids": [block_ids],
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": md.engine_id,
            "remote_request_id": request_id,
            "remote_host": md.host,
            "remote_port": md.port,
            "tp_size": md.tp_size,
            "pp_size": 1,
            "transfer_mode": "push",
        }


_V = TypeVar("_V")
RECENT = 4096  # outcomes kept for late PushWaitReqs


def _remember(d: OrderedDict[str, _V], key: str, value: _V) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > RECENT:
        d.popitem(last=False)
