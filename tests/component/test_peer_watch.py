"""kvpush.peers.watch on real sockets: a refused connection marks a peer, anything else not."""

from __future__ import annotations

import socket
import threading

from kvpush.peers.watch import PeerWatch, refused


def test_refused_is_true_only_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert refused("127.0.0.1", port, 1.0) is False
    assert refused("127.0.0.1", port, 1.0) is True  # closed: nothing listens there any more


def test_the_watch_reports_the_peer_that_refuses_and_not_the_one_that_listens() -> None:
    with socket.socket() as alive, socket.socket() as gone:
        alive.bind(("127.0.0.1", 0))
        alive.listen()
        gone.bind(("127.0.0.1", 0))
        gone_port = gone.getsockname()[1]
        gone.close()
        seen: list[tuple[object, str]] = []
        reported = threading.Event()

        def on_refused(token: object, why: str) -> None:
            seen.append((token, why))
            reported.set()

        targets = [("alive", "127.0.0.1", alive.getsockname()[1]), ("gone", "127.0.0.1", gone_port)]
        w = PeerWatch(lambda quiet_s: list(targets), on_refused, every_s=0.05)
        w.start()
        try:
            assert reported.wait(10)
        finally:
            w.stop()
        assert seen[0] == ("gone", f"connection to 127.0.0.1:{gone_port} refused")
        assert all(token == "gone" for token, _ in seen)
