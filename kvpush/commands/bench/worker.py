"""One benchmark worker process: hosts one endpoint (or a raw baseline) and runs load on it.

Usage: ``python -m kvpush.commands.bench.worker`` (started by ``kvpush.commands.bench.procs``, never
by hand).

Protocol: JSON lines. The orchestrator writes ``{"id", "cmd", "args"}`` lines to stdin; the
worker answers each with one ``{"id", "ok", "result" | "error"}`` line on its *private* copy of
the original stdout (fd 1 itself is pointed at stderr, so whatever NIXL, UCX or a library prints
can never corrupt the protocol; stderr goes to the worker's log file). Every command runs on its
own thread, so a long load command and a ``stats`` or ``cpu`` query can overlap. EOF on stdin
(the orchestrator died or is done) stops the endpoint and exits.

Why load is generated *inside* the endpoint processes: the product's callers (the model engine)
call ``prefill()``/``decode()`` in-process, and on a 2-core host a separate driver that sends two
side-channel requests per push would itself be the bottleneck. The generators here cost what an
engine's call costs, and the numbers are what the endpoint measures (``DecodeRep.latency_s``:
from ``decode()`` to verified completion, on D's monotonic clock).

Threads: the main thread reads commands; one thread per command; the endpoint's own threads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NotRequired, TextIO, TypedDict, cast

from kvpush import logsafe
from kvpush.commands.bench.worker_state import WorkerState

_out_lock = threading.Lock()
_out: TextIO | None = None


class _Command(TypedDict):
    """One line from the orchestrator (``kvpush.commands.bench.procs.Worker.call_async``)."""

    id: int
    cmd: str
    args: NotRequired[dict[str, object]]


def _emit(msg: dict[str, object]) -> None:
    line = json.dumps(msg, separators=(",", ":"))
    with _out_lock:
        assert _out is not None  # set by main() before the first command
        _out.write(line + "\n")
        _out.flush()


def _commands(state: WorkerState) -> dict[str, Callable[..., object]]:
    from kvpush.commands.bench import (
        devcopy,
        host_limits,
        loadgen,
        modelgen,
        probes,
        raw,
        raw_node,
        raw_notifs,
    )

    return {
        "start_endpoint": lambda **a: loadgen.start_endpoint(state, **a),
        "stop": lambda **a: _stop(state),
        "sleep": lambda s: time.sleep(s),
        **{name: _bind(fn, state) for name, fn in loadgen.COMMANDS.items()},
        **{name: _bind(fn, state) for name, fn in probes.COMMANDS.items()},
        **{name: _bind(fn, state) for name, fn in raw_node.COMMANDS.items()},
        **{name: _bind(fn, state) for name, fn in raw.COMMANDS.items()},
        **{name: _bind(fn, state) for name, fn in raw_notifs.COMMANDS.items()},
        **{name: _bind(fn, state) for name, fn in host_limits.COMMANDS.items()},
        **{name: _bind(fn, state) for name, fn in modelgen.COMMANDS.items()},
        **{name: _bind(fn, state) for name, fn in devcopy.COMMANDS.items()},
    }


def _bind(fn: Callable[..., object], state: WorkerState) -> Callable[..., object]:
    return lambda **a: fn(state, **a)


def _stop(state: WorkerState) -> None:
    state.stopping.set()
    ep = state.endpoint.take()
    if ep is not None:
        ep.stop(2.0)
    node = state.raw.take()
    if node is not None:
        node.close()


def _run_one(cmds: dict[str, Callable[..., object]], msg: _Command) -> None:
    mid = msg.get("id")
    try:
        fn = cmds[msg["cmd"]]
        result = fn(**msg.get("args", {}))
        _emit({"id": mid, "ok": True, "result": result})
    except BaseException as e:  # reported to the orchestrator, which raises it there
        logging.getLogger("kvpush.commands.bench.worker").exception(
            "command %s failed", msg.get("cmd")
        )
        _emit(
            {
                "id": mid,
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-4000:],
            }
        )


def main() -> int:
    global _out
    # Keep a private handle on the real stdout for the protocol; send fd 1 to stderr.
    _out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(
        level=os.environ.get("KVPUSH_BENCH_LOG", "WARNING"),
        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for h in logging.getLogger().handlers:
        logsafe.install(h)
    state = WorkerState()
    cmds = _commands(state)
    _emit({"id": 0, "ok": True, "result": {"pid": os.getpid()}})
    threads: list[threading.Thread] = []
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = cast(_Command, json.loads(line))
        if msg.get("cmd") == "stop":
            _run_one(cmds, msg)
            break
        t = threading.Thread(
            target=_run_one, args=(cmds, msg), name=f"cmd-{msg['cmd']}", daemon=True
        )
        t.start()
        threads.append(t)
    if not state.stopping.is_set():
        try:
            _stop(state)
        except Exception:
            logging.getLogger("kvpush.commands.bench.worker").exception("stop failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
