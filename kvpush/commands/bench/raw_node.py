"""The raw baselines' NIXL node in a bench worker: one NIXL agent without kvpush, registering
one pool-shaped buffer (``RawNode``, held as the worker's ``state.raw``).

Everything NIXL goes through ``kvpush.transport.nixl.NixlAgent`` (the only module that imports
nixl), with the same agent configuration knobs kvpush exposes (``AgentConfig``). The buffer has
the shape of a kvpush pool, ``(regions, num_blocks, block_bytes)``.

A *target* registers its buffer and, with the progress thread off, polls its agent
(``get_notifs``) on a thread: without that polling the first WRITE to it never completes.
``raw_node`` makes a node with a fresh buffer. ``kvpush bench model`` uses ``raw_pool_node``
instead: a second agent registering the endpoint's own pool tensor, its poller paused while
kvpush runs (``raw_poll``); ``raw_prepare`` loads a target into it with both whole-pool
descriptor lists prepared once. The WRITE loops are ``kvpush.commands.bench.raw``; the machine's own
limits, on the same buffers, ``kvpush.commands.bench.host_limits``.

Threads: the worker's command threads (create, prepare, close); the node's polling thread.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from kvpush.commands.bench.worker_state import WorkerState

if TYPE_CHECKING:
    import torch

    from kvpush.transport.nixl import NixlAgent


log = logging.getLogger(__name__)


class RawNodeInfo(TypedDict):
    """A raw node as another worker loads it (the reply of ``raw_node`` / ``raw_pool_node``)."""

    metadata: str  # the agent's full NIXL metadata, base64
    bases: list[int]  # each region's base address
    pid: int
    geometry: list[int]  # [regions, num_blocks, block_bytes]
    mem_type: str  # NIXL's: DRAM or VRAM


def pool_buffer(regions: int, num_blocks: int, block_bytes: int) -> torch.Tensor:
    """A zeroed ``(regions, num_blocks, block_bytes)`` uint8 tensor: a kvpush pool's shape."""
    import torch

    # torch.zeros touches every page (as KvPool does), so no page faults in the timed part.
    return torch.zeros((regions, num_blocks, block_bytes), dtype=torch.uint8)


def mem_type(t: torch.Tensor) -> str:
    """NIXL's memory type of a tensor: ``VRAM`` on a GPU, else ``DRAM``."""
    return "VRAM" if getattr(t, "is_cuda", False) else "DRAM"


def region_bases(t: torch.Tensor) -> list[int]:
    """The base address of each region of a pool-shaped tensor."""
    base = int(t.data_ptr())
    stride = int(t.shape[1] * t.shape[2])
    return [base + r * stride for r in range(int(t.shape[0]))]


class RawNode:
    """A NIXL agent with one registered pool-shaped buffer; optionally polling notifications."""

    def __init__(
        self,
        regions: int,
        num_blocks: int,
        block_bytes: int,
        progress_thread: bool,
        poll: str,
        tensor: torch.Tensor | None = None,
        paused: bool = False,
    ) -> None:
        from kvpush.config import AgentConfig
        from kvpush.transport.nixl import NixlAgent

        self.geometry = (regions, num_blocks, block_bytes)
        # ``tensor``: an existing (regions, num_blocks, block_bytes) buffer, e.g. a pool's.
        self.tensor = pool_buffer(regions, num_blocks, block_bytes) if tensor is None else tensor
        self.agent = NixlAgent(
            f"raw-{uuid.uuid4().hex[:12]}", AgentConfig(progress_thread=progress_thread)
        )
        self.agent.register(self.tensor)
        self.peer: _Peer | None = None
        self.notifs = 0
        # A notification loop's target (``raw_notifs``): each time the count reaches the first
        # of ``expects``, that many are taken off it and one b"done" goes back to ``reply_to``
        # (the initiator's agent name, loaded into ``remotes``: metadata -> name).
        self.expects: deque[int] = deque()
        self.reply_to = ""
        self.remotes: dict[str, str] = {}
        self._stop = threading.Event()
        self._active = threading.Event()
        if not paused:
            self._active.set()
        self._poll_mode = poll
        self._poller: threading.Thread | None = None
        if poll != "none":
            self._poller = threading.Thread(target=self._poll, name="raw-poller", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        # "spin": poll back to back, yielding the GIL; "backoff": like kvpush's IdleWaiter
        # (spin 2 ms after activity, then sleep up to 1 ms).
        last = time.monotonic()
        sleep = 50e-6
        while not self._stop.is_set():
            if not self._active.is_set():  # paused: no CPU taken from what runs meanwhile
                self._active.wait(0.05)
                last = time.monotonic()
                continue
            got = self.agent.get_notifs()
            n = sum(len(v) for v in got.values())
            if n:
                self.notifs += n
                last = time.monotonic()
                sleep = 50e-6
                if self.expects and self.notifs >= self.expects[0]:
                    self.notifs -= self.expects.popleft()
                    try:  # the initiator may be gone: its loop times out and says so
                        self.agent.send_notif(self.reply_to, b"done")
                    except Exception as e:
                        log.warning("raw node: the reply to %s failed: %s", self.reply_to, e)
                continue
            if self._poll_mode == "spin" or time.monotonic() - last < 0.002:
                time.sleep(0)
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, 0.001)

    def info(self) -> RawNodeInfo:
        import os

        return {
            "metadata": base64.b64encode(self.agent.metadata_full()).decode(),
            "bases": region_bases(self.tensor),
            "pid": os.getpid(),
            "geometry": list(self.geometry),
            "mem_type": mem_type(self.tensor),
        }

    def set_polling(self, on: bool) -> None:
        if on:
            self._active.set()
        else:
            self._active.clear()

    def close(self) -> None:
        self._stop.set()
        self._active.set()
        if self._poller is not None:
            self._poller.join(2)
        if self.peer is not None:
            self.peer.close(self.agent)
            self.peer = None
        for name in self.remotes.values():
            self.agent.remove_remote(name)
        self.remotes.clear()
        self.agent.close()


def raw_node(
    state: WorkerState,
    regions: int,
    num_blocks: int,
    block_bytes: int,
    progress_thread: bool = False,
    poll: str = "spin",
) -> RawNodeInfo:
    old = state.raw.peek()
    if old is not None:
        old.close()
    node = RawNode(regions, num_blocks, block_bytes, progress_thread, poll)
    state.raw.put(node)
    return node.info()


def raw_close(state: WorkerState) -> None:
    node = state.raw.take()
    if node is not None:
        node.close()


def block_starts(num_blocks: int, blocks: int, count: int) -> list[int]:
    """Start block of each distinct transfer: consecutive, non-overlapping, cycling the pool."""
    per = max(1, num_blocks // blocks)
    return [(k % per) * blocks for k in range(min(count, per))]


class _Peer:
    """A target loaded into a raw initiator, both whole-pool descriptor lists prepped once."""

    def __init__(self, agent: NixlAgent, node: RawNode, target: RawNodeInfo) -> None:
        from kvpush.memory.descriptors import block_descs

        regions, num_blocks, block_bytes = node.geometry
        t_regions, t_blocks, t_bb = target["geometry"]
        if (t_regions, t_bb) != (regions, block_bytes):
            raise ValueError(f"geometry mismatch: {node.geometry} vs {target['geometry']}")
        self.target = target
        self.t_blocks = int(t_blocks)
        self.name = agent.add_remote(base64.b64decode(target["metadata"]))
        self.local = agent.prep_local(
            block_descs(region_bases(node.tensor), num_blocks, block_bytes, 0),
            mem_type(node.tensor),
        )
        self.remote = agent.prep_remote(
            self.name,
            block_descs(target["bases"], t_blocks, block_bytes, 0),
            target.get("mem_type", "DRAM"),
        )
        agent.make_connection(self.name)

    def close(self, agent: NixlAgent) -> None:
        agent.release_dlist(self.local)
        agent.release_dlist(self.remote)
        agent.remove_remote(self.name)


def raw_pool_node(state: WorkerState, poll: str = "spin", paused: bool = True) -> RawNodeInfo:
    """A raw agent registering this endpoint's own pool tensor (a second registration of the
    same memory), its poller ``paused`` until ``raw_poll(on=True)``."""
    old = state.raw.peek()
    if old is not None:
        old.close()
    t = state.endpoint.get().pool.as_tensor()
    regions, num_blocks, block_bytes = (int(x) for x in t.shape)
    node = RawNode(regions, num_blocks, block_bytes, False, poll, tensor=t, paused=paused)
    state.raw.put(node)
    return node.info()


def raw_poll(state: WorkerState, on: bool) -> None:
    state.raw.get().set_polling(on)


def raw_prepare(state: WorkerState, target: RawNodeInfo) -> None:
    """Load ``target`` (a ``raw_pool_node`` info) and prep both pools' descriptor lists."""
    node = state.raw.get()
    if node.peer is not None:
        node.peer.close(node.agent)
    node.peer = None
    node.peer = _Peer(node.agent, node, target)


COMMANDS: dict[str, Callable[..., object]] = {
    "raw_node": raw_node,
    "raw_close": raw_close,
    "raw_pool_node": raw_pool_node,
    "raw_poll": raw_poll,
    "raw_prepare": raw_prepare,
}
