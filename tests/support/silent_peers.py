"""Peers that never answer: ``BlackHole`` (a bound ZMQ ROUTER that completes ZMTP and never
replies) and ``SilentListener`` (a TCP listener that accepts and never sends a byte; its accept
loop runs on a daemon thread of its own)."""

from __future__ import annotations

import socket
import threading


class BlackHole:
    """A bound ZMQ ROUTER that completes ZMTP and never answers (a wedged side channel)."""

    def __enter__(self) -> BlackHole:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close(0)
        self._ctx.term()


class SilentListener:
    """A TCP listener that accepts connections and never sends a byte."""

    def __enter__(self) -> SilentListener:
        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self._srv.settimeout(0.1)
        self.port = int(self._srv.getsockname()[1])
        self.address = f"127.0.0.1:{self.port}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="silent-listener", daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._srv.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            self._conns.append(c)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(2)
        for c in self._conns:
            c.close()
        self._srv.close()
