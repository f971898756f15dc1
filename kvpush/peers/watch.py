"""Whether connected peers still exist: a refused connection to a peer's side channel means its
process is gone, so its row must not read ``connected`` until ``--peer-idle-ttl`` lapses.

Owns ``PeerWatch``: one daemon thread per handshake manager (per rank), started with the first
connected peer and stopped by ``PeerTable.close``. Every ``every_s`` it takes the
connected peers that no push or request used for ``quiet_s`` (a busy peer's own traffic finds
it gone sooner: a failed WRITE, heartbeat or PUSH_REG evicts it) and tries a plain TCP connect to
each one's side channel, at most ``timeout_s`` each: *refused* (nothing listens there any more)
marks the peer down (``PeerTable._mark_down``: its row reads ``down`` at once, and the
owner evicts it at its next housekeeping, releasing the connection); a timeout proves nothing
(a frozen or far peer) and changes nothing. No bytes are sent: a side channel sees a connection
open and close. Each check costs one connect per quiet peer every ``every_s`` (2 s): nothing
measurable next to an endpoint's idle loop.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

WATCH_EVERY_S = 2.0
QUIET_S = 2.0
CONNECT_TIMEOUT_S = 1.0

Target = tuple[object, str, int]  # (what to report back, host, port)


def refused(host: str, port: int, timeout_s: float) -> bool:
    """True when nothing listens at ``host:port`` (the connection was refused)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError as e:
        return e.errno == errno.ECONNREFUSED


class PeerWatch:
    def __init__(
        self,
        targets: Callable[[float], list[Target]],
        on_refused: Callable[[object, str], None],
        *,
        every_s: float = WATCH_EVERY_S,
        quiet_s: float = QUIET_S,
        timeout_s: float = CONNECT_TIMEOUT_S,
        name: str = "peer-watch",
    ) -> None:
        self._targets = targets  # quiet_s -> the peers to check now
        self._on_refused = on_refused
        self._every = every_s
        self._quiet = quiet_s
        self._timeout = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                for token, host, port in self._targets(self._quiet):
                    if self._stop.is_set():
                        return
                    if refused(host, port, self._timeout):
                        self._on_refused(token, f"connection to {host}:{port} refused")
            except Exception:  # a watch that dies would leave ghosts again: log, go on
                log.exception("peer watch: a check failed")
