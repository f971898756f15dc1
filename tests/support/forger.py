"""A third process with its own NIXL agent that forges notifications: ``Forger``.

The forger learns a peer's agent through a real side-channel handshake (with the token, if given)
and sends it forged or junk notifications (``tests.support.junk.junk_notifs``), with or without
the token. ``Forger`` starts it (``python -m tests.support.forger``) and drives it: the process
reads one JSON command per line on stdin and answers one JSON line per command on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.support.junk import junk_notifs
from tests.support.procs import ROOT


class Forger:
    """Drive a forger process (``python -m tests.support.forger``) with JSON commands."""

    def __init__(self, tmp: Path, name: str = "forger") -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.log = tmp / f"{name}.log"
        self._lf = open(self.log, "ab")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forger"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._lf,
            env=env,
        )
        hello = self._read(30)
        assert hello.get("ready"), hello
        self.agent_name = str(hello["agent"])

    def _read(self, timeout_s: float) -> dict[str, Any]:
        stdout = self.popen.stdout
        assert stdout is not None
        box: list[bytes] = []
        t = threading.Thread(target=lambda: box.append(stdout.readline()))
        t.daemon = True
        t.start()
        t.join(timeout_s)
        if not box or not box[0]:
            raise AssertionError(f"forger did not answer:\n{self.log.read_text(errors='replace')}")
        out: dict[str, Any] = json.loads(box[0])
        return out

    def cmd(self, timeout_s: float = 60.0, **c: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(c) + "\n").encode())
        self.popen.stdin.flush()
        rep = self._read(timeout_s)
        if "error" in rep and not c.get("allow_error"):
            raise AssertionError(f"forger {c.get('op')} failed: {rep['error']}")
        return rep

    def connect(
        self, address: str, token: str | None = None, mode: str = "notif"
    ) -> dict[str, Any]:
        """Real handshake: fetch the peer's metadata (with ``token`` if given), load its agent."""
        return self.cmd(op="connect", address=address, token=token, mode=mode)

    def send(
        self,
        to: str,
        msg: dict[str, Any] | list[dict[str, Any]],
        token: str | None = None,
        repeat: int = 1,
    ) -> None:
        """Send typed notifications (``msg["type"]`` = a protocol struct name) sealed with
        ``token`` (None: no tag), each ``repeat`` times with the same bytes (a replay)."""
        msgs = msg if isinstance(msg, list) else [msg]
        self.cmd(op="send", to=to, msgs=msgs, msg=None, token=token, repeat=repeat)

    def junk(self, to: str, count: int, seed: int = 0) -> int:
        return int(self.cmd(op="junk", to=to, count=count, seed=seed)["sent"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cmd(op="quit", timeout_s=10)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                f.close()
        self._lf.close()


class _Forging:  # pragma: no cover - runs in the forger process
    """The forger process's side: its NIXL agent, the peers it loaded, one method per op."""

    def __init__(self) -> None:
        from kvpush.config import AgentConfig
        from kvpush.transport.nixl import NixlAgent
        from kvpush.wire import protocol

        self.agent = NixlAgent(f"forger-{uuid.uuid4().hex[:8]}", AgentConfig())
        self.peers: dict[str, str] = {}  # address -> agent name
        self.types = {
            "PushReg": protocol.PushReg,
            "Completion": protocol.Completion,
            "Failure": protocol.Failure,
            "Fence": protocol.Fence,
            "Cancel": protocol.Cancel,
            "Heartbeat": protocol.Heartbeat,
            "Ping": protocol.Ping,
        }

    def progress(self, seconds: float) -> int:
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n += sum(len(v) for v in self.agent.get_notifs().values())
            time.sleep(0.001)
        return n

    def connect(self, c: dict[str, Any]) -> dict[str, Any]:
        from kvpush.transport.client import SideChannelClient
        from kvpush.wire import protocol
        from kvpush.wire.auth import Authenticator

        host, port = c["address"].rsplit(":", 1)
        tok = c.get("token")
        auth = Authenticator(tok.encode() if tok else None)
        with SideChannelClient(host, int(port), auth=auth, timeout_s=5) as cl:
            rep = cl.request(protocol.HandshakeReq(mode=c.get("mode", "notif")))
        assert isinstance(rep, protocol.HandshakeRep), rep
        md = protocol.decode_metadata(rep.metadata)
        name = self.agent.add_remote(rep.agent_metadata)
        self.agent.make_connection(name)
        self.peers[c["address"]] = name
        self.progress(0.05)
        return {
            "ok": True,
            "agent_name": name,
            "engine_id": md.engine_id,
            "incarnation": md.incarnation,
            "num_blocks": md.num_blocks,
        }

    def send(self, c: dict[str, Any]) -> dict[str, Any]:
        from kvpush.wire.auth import Authenticator
        from kvpush.wire.notifs import NotifCodec

        tok = c.get("token")
        codec = NotifCodec(Authenticator(tok.encode() if tok else None))
        for m in c.get("msgs") or [c["msg"]]:
            msg = dict(m)
            cls = self.types[msg.pop("type")]
            data = codec.encode(cls(**msg))
            for _ in range(int(c.get("repeat", 1))):
                self.agent.send_notif(self.peers[c["to"]], data)
            self.progress(0.0)
        self.progress(0.05)
        return {"ok": True}

    def junk(self, c: dict[str, Any]) -> dict[str, Any]:
        sent = 0
        for data in junk_notifs(int(c.get("seed", 0)), int(c["count"])):
            self.agent.send_notif(self.peers[c["to"]], data)
            sent += 1
            if sent % 64 == 0:
                self.progress(0.0)
        self.progress(1.0)  # let UCX flush: sends still queued here die with this process
        return {"ok": True, "sent": sent}

    def close(self) -> None:
        for name in self.peers.values():
            self.agent.remove_remote(name)
        self.agent.close()


def _forger_main() -> int:  # pragma: no cover - runs in the forger process
    forging = _Forging()
    ops = {"connect": forging.connect, "send": forging.send, "junk": forging.junk}
    out = sys.stdout

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    answer({"ready": True, "agent": forging.agent.name})
    for line in sys.stdin:
        c = json.loads(line)
        op = c.get("op")
        try:
            if op == "quit":
                answer({"ok": True})
                break
            if op in ops:
                answer(ops[op](c))
            else:
                answer({"error": f"unknown op {op!r}"})
        except Exception as e:
            answer({"error": f"{type(e).__name__}: {e}"})
    forging.close()
    return 0


if __name__ == "__main__":
    sys.exit(_forger_main())
