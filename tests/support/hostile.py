"""Well-formed but hostile side-channel traffic for the hostile suites (issue 17).

``Flood`` sends many requests down one connection without waiting for each answer (what one
hostile client can do), every one encoded the way ``kvpush.transport.client`` encodes its own
(``protocol.encode`` + ``Authenticator.seal`` + ``MAGIC_REQ``), and collects the replies by
request id. ``Drive`` runs ``kvpush drive`` beside it. Real sockets, no fakes.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import msgspec
import zmq

from kvpush.wire import protocol
from kvpush.wire.auth import CH_REPLY, CH_REQUEST, Authenticator
from tests.support.procs import KVPUSH, clean_env


class Flood:
    """One DEALER connection to a side channel, pipelining requests."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(f"tcp://{host}:{port}")
        self._auth = Authenticator(None)
        self._rid = 0
        self.sent: dict[int, Any] = {}
        self.replies: dict[int, protocol.SideReply] = {}

    def send(self, req: Any) -> int:
        self._rid += 1
        req = msgspec.structs.replace(req, rid=self._rid)
        env = self._auth.seal(CH_REQUEST, protocol.encode(req))
        self._sock.send_multipart([b"", protocol.MAGIC_REQ + env])
        self.sent[self._rid] = req
        return self._rid

    def collect(self, n: int, timeout_s: float) -> dict[int, protocol.SideReply]:
        """Read replies until ``n`` arrived in all (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while len(self.replies) < n and time.monotonic() < deadline:
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart()
            env = protocol.decode_envelope(
                frames[-1], protocol.MAGIC_REP, 1 << 24, "side-channel reply"
            )
            try:
                body = self._auth.open(CH_REPLY + env.nonce, env)
            except Exception:
                body = self._auth.open(CH_REPLY, env)
            rep = protocol.decode_reply_body(body)
            self.replies[rep.rid] = rep
        return self.replies

    def close(self) -> None:
        self._sock.close(0)


def reason_of(rep: protocol.SideReply) -> str:
    """The named reason of a refusal (an ``ErrorRep``'s code or a failed answer's reason)."""
    if isinstance(rep, protocol.ErrorRep):
        return rep.code
    return str(getattr(rep, "reason", ""))


class Drive:
    """``kvpush drive`` in the background; ``result()`` its JSON summary and exit status."""

    def __init__(self, p: str, d: str, n: int, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*KVPUSH, "drive", "-p", p, "-d", d, "-n", str(n), "--json", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=clean_env(),
        )

    def result(self, timeout_s: float = 120.0) -> tuple[int, dict[str, Any], str]:
        out, err = self.proc.communicate(timeout=timeout_s)
        summary: dict[str, Any] = {}
        for line in out.splitlines():
            if line.startswith("{"):
                summary = json.loads(line)
        return self.proc.returncode, summary, err


def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0
