"""Raw NIXL notifications without kvpush, run inside two bench workers on their ``RawNode``s
(``kvpush.commands.bench.raw_node``): the notification floor ``kvpush bench rate`` sets beside
kvpush's own notifications (a PUSH_REG batch D -> P, a completion P -> D).

The *target* (``raw_notif_target``) loads the initiator's metadata and is told how many
notifications to expect: its polling thread counts them and, at each expected count, sends one
b"done" back. The *initiator* (``raw_notif_loop``) sends ``warmup`` notifications and waits for
the first b"done", then sends ``n`` back to back (NIXL's ``send_notif``, nothing windowed: UCX
queues what the lane cannot take yet) and polls its agent (which progresses the sends) until the
second b"done". Rate = ``n`` / (first send -> b"done"); CPU per notification is the initiator's
thread (sending and progressing) and process.

Threads: each worker's command thread; the target's polling thread counts and replies.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import TypedDict

from kvpush.commands.bench.probes import process_cpu_s
from kvpush.commands.bench.raw_node import RawNodeInfo
from kvpush.commands.bench.worker_state import WorkerState

#: Bytes of each notification: about a kvpush completion naming one push (~100 B on the wire).
NOTIF_BYTES = 64


class RawNotifResult(TypedDict):
    """The reply of ``raw_notif_loop``."""

    n: int
    size: int
    elapsed_s: float
    per_s: float
    send_us: float  # wall time a send_notif call took, on average
    thread_cpu_us: float  # the initiator's loop thread, a notification
    cpu_us: float  # the initiator's process, a notification


def raw_notif_target(state: WorkerState, initiator: RawNodeInfo, expect: list[int]) -> None:
    """Load ``initiator`` (once) to reply to, and expect these counts of notifications, in
    order: one b"done" goes back as each is reached."""
    node = state.raw.get()
    md = initiator["metadata"]
    name = node.remotes.get(md)
    if name is None:
        name = node.remotes[md] = node.agent.add_remote(base64.b64decode(md))
        node.agent.make_connection(name)
    node.expects.clear()  # what an earlier loop that timed out still expected
    node.reply_to = name
    node.notifs = 0
    node.expects.extend(expect)


def raw_notif_loop(
    state: WorkerState,
    target: RawNodeInfo,
    n: int,
    warmup: int = 200,
    size: int = NOTIF_BYTES,
    timeout_s: float = 60.0,
) -> RawNotifResult:
    """``warmup`` then ``n`` notifications of ``size`` bytes to ``target`` (told to expect
    ``[warmup, n]``), each batch timed to the target's b"done"."""
    node = state.raw.get()
    agent = node.agent
    name = agent.add_remote(base64.b64decode(target["metadata"]))
    msg = b"n" * size
    try:
        agent.make_connection(name)

        def batch(count: int) -> tuple[float, float]:
            t0 = time.monotonic()
            for _ in range(count):
                agent.send_notif(name, msg)
            t_sent = time.monotonic()
            while not any(b"done" in v for v in agent.get_notifs().values()):
                if time.monotonic() - t_sent > timeout_s:
                    raise TimeoutError(f"the raw target did not count {count} notifications")
                time.sleep(0)
            return t_sent - t0, time.monotonic() - t0

        batch(warmup)
        c0, th0 = process_cpu_s(), time.thread_time()
        sending, elapsed = batch(n)
        cpu, thread = process_cpu_s() - c0, time.thread_time() - th0
    finally:
        agent.remove_remote(name)
    return {
        "n": n,
        "size": size,
        "elapsed_s": elapsed,
        "per_s": n / elapsed,
        "send_us": sending / n * 1e6,
        "thread_cpu_us": thread / n * 1e6,
        "cpu_us": cpu / n * 1e6,
    }


COMMANDS: dict[str, Callable[..., object]] = {
    "raw_notif_target": raw_notif_target,
    "raw_notif_loop": raw_notif_loop,
}
