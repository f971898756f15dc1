"""Observation-only NIXL wiretap for a vLLM worker; runs inside the vLLM venv (imported by peer.py).

Adapted from the team's vllm-harness. ``install`` wraps the worker's NIXL agent methods so that
every notification sent (``send_notif``) and received (``get_new_notifs``), every transfer
posted (``make_prepped_xfer``, ``transfer``), every remote agent loaded (``add_remote_agent``) and
every descriptor list prepared (``prep_xfer_dlist``) is appended to a JSONL file. Each wrapper
calls the original with the same arguments and returns its result unchanged, so vLLM behaves as
it would without the tap. Records come from several threads (the engine main thread sends
heartbeats, vLLM's ``nixl-push-writer`` thread drains notifications and posts WRITEs, the
handshake executor loads agents): one lock serialises the writes.

Record shape: ``{"t": unix time, "role": "P"|"D", "kind": ..., ...}``; notifications carry a
decoded ``msg`` (``PUSH_REG`` with its payload, ``HB``, ``completion``, ``other`` or ``binary``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

PUSH_REG = b"PUSH_REG:"
_MAX_HEX = 512  # bytes of a foreign binary notification kept in the log


def _b(x: Any) -> Any:
    if isinstance(x, (bytes, bytearray)):
        try:
            return bytes(x).decode()
        except UnicodeDecodeError:
            return "hex:" + bytes(x)[:_MAX_HEX].hex()
    return x


def _as_bytes(x: Any) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(_b(k)): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (bytes, bytearray)):
        return _b(o) if len(o) < 200 else f"<{len(o)} bytes>"
    return o


def decode_notif(msg: bytes) -> dict[str, Any]:
    """Classify a notification the way vLLM's push worker reads it (without raising)."""
    if msg.startswith(PUSH_REG):
        try:
            payload = _jsonable(msgspec.msgpack.decode(msg[len(PUSH_REG) :]))
        except Exception as e:  # a malformed PUSH_REG is logged, not fatal to the tap
            payload = {"undecodable": repr(e)}
        return {"type": "PUSH_REG", "len": len(msg), "payload": payload}
    try:
        s = msg.decode()
    except UnicodeDecodeError:
        return {"type": "binary", "len": len(msg), "hex": msg[:_MAX_HEX].hex()}
    if s.startswith("HB:"):
        return {"type": "HB", "raw": s}
    # vLLM's completion form is "<D request id>:<int>"; anything else kills its engine.
    head, sep, tail = s.rpartition(":")
    if sep and head and tail.isdigit():
        return {"type": "completion", "raw": s}
    return {"type": "other", "raw": s[:_MAX_HEX]}


class Tap:
    """The JSONL sink; ``rec`` may be called from any thread."""

    def __init__(self, path: str, role: str) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 -- lives as long as the process
        self._lock = threading.Lock()
        self.role = role

    def rec(self, kind: str, **kw: Any) -> None:
        line = json.dumps(
            {"t": round(time.time(), 6), "role": self.role, "kind": kind, **kw}, default=str
        )
        with self._lock:
            if not self._f.closed:  # a straggling vLLM thread after shutdown: dropped
                self._f.write(line + "\n")
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def install(worker: Any, path: str, role: str) -> Tap:
    """Wrap ``worker.nixl_wrapper``'s methods (instance attributes shadow the bound methods)."""
    nw = worker.nixl_wrapper
    tap = Tap(path, role)
    rec = tap.rec
    o_send: Callable[..., Any] = nw.send_notif
    o_get: Callable[..., Any] = nw.get_new_notifs
    o_make: Callable[..., Any] = nw.make_prepped_xfer
    o_xfer: Callable[..., Any] = nw.transfer
    o_add: Callable[..., Any] = nw.add_remote_agent
    o_prep: Callable[..., Any] = nw.prep_xfer_dlist

    def send_notif(remote_agent_name: Any, notif_msg: Any = b"", *a: Any, **k: Any) -> Any:
        rec("send_notif", to=_b(remote_agent_name), msg=decode_notif(_as_bytes(notif_msg)))
        return o_send(remote_agent_name, notif_msg, *a, **k)

    def get_new_notifs(*a: Any, **k: Any) -> Any:
        out = o_get(*a, **k)
        for agent, msgs in out.items():
            for m in msgs:
                rec("recv_notif", frm=_b(agent), msg=decode_notif(bytes(m)))
        return out

    def make_prepped_xfer(
        op: Any, lh: Any, lids: Any, rh: Any, rids: Any, notif_msg: Any = b"", *a: Any, **k: Any
    ) -> Any:
        h = o_make(op, lh, lids, rh, rids, notif_msg, *a, **k)
        rec(
            "make_prepped_xfer",
            op=op,
            handle=int(h) if isinstance(h, int) else str(h),
            local_desc_ids=[int(x) for x in lids],
            remote_desc_ids=[int(x) for x in rids],
            notif_msg=_b(_as_bytes(notif_msg)),
        )
        return h

    def transfer(handle: Any, *a: Any, **k: Any) -> Any:
        state = o_xfer(handle, *a, **k)
        rec("transfer", handle=int(handle) if isinstance(handle, int) else str(handle), state=state)
        return state

    def add_remote_agent(md: bytes) -> Any:
        name = o_add(md)
        rec("add_remote_agent", name=_b(name), md_len=len(md))
        return name

    def prep_xfer_dlist(agent: Any, descs: Any, *a: Any, **k: Any) -> Any:
        h = o_prep(agent, descs, *a, **k)
        try:
            n = descs.descCount()
        except Exception:
            n = len(descs) if hasattr(descs, "__len__") else None
        rec("prep_xfer_dlist", agent=_b(agent), num_descs=n)
        return h

    nw.send_notif = send_notif
    nw.get_new_notifs = get_new_notifs
    nw.make_prepped_xfer = make_prepped_xfer
    nw.transfer = transfer
    nw.add_remote_agent = add_remote_agent
    nw.prep_xfer_dlist = prep_xfer_dlist
    return tap
