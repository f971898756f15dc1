"""A watch on etcd's JSON gateway: its stream opened, its events read, shut from any thread.

Owns the watch's HTTP stream: ``open_stream`` opens it on a ``requests`` session of its own
(bounded connect, unbounded reads: a quiet cluster sends nothing for hours); ``read_events``
turns the gateway's stream (one JSON object per line, a line may arrive in pieces or several in
one chunk) into ``WatchEvent``s, raising on etcd's errors and cancels (``WatchCompacted`` for a
compacted revision); ``shutdown`` wakes a thread blocked reading it. ``Etcd.watch_prefix``
(``kvpush.fleet.etcd``) puts them together and says what a broken stream means.

Threads: ``read_events`` runs on the thread that iterates the watch (the watcher's);
``shutdown`` on any thread (``cancel``).
"""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import requests

from kvpush.errors import WatchCompacted

if TYPE_CHECKING:
    from kvpush.fleet.etcd import Url


class Unreachable(Exception):
    """An etcd URL did not answer (refused, timed out, 503: no leader): try the next one."""


class EtcdRefused(Exception):
    """etcd answered with an error: its HTTP status and body (JSON with its message)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix. ``value`` is empty for a DELETE."""

    kind: Literal["PUT", "DELETE"]
    key: str
    value: bytes
    revision: int  # the etcd revision of this change (the key's mod_revision)


def open_stream(c: Url, create: dict[str, str], timeout_s: float) -> requests.Response:
    """Open a watch (``create``: etcd's create_request) on a session of its own, with ``c``'s
    credentials and TLS material. Errors are ``Unreachable`` / ``EtcdRefused``, so ``Etcd``
    fails over as for every other call."""
    s = requests.Session()
    s.verify = c.verify
    s.cert = c.session.cert
    s.headers.update(c.session.headers)
    try:
        # connect bounded; reads unbounded (a quiet cluster sends nothing for hours)
        r = s.post(
            c.base + "/watch",
            json={"create_request": create},
            stream=True,
            timeout=(timeout_s, None),
            verify=c.verify,
        )
    except (requests.exceptions.RequestException, OSError) as e:
        s.close()
        raise Unreachable(str(e)) from None
    if r.status_code != 200:
        text = r.text
        s.close()
        if r.status_code in (503, 408, 504):
            raise Unreachable(text)
        raise EtcdRefused(r.status_code, text)
    return r


def read_events(resp: requests.Response, prefix: str) -> Iterator[WatchEvent]:
    """Events out of the gateway's stream: one JSON object per line, a line may arrive in
    pieces or several in one chunk."""
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if not line.strip():
                continue
            msg = json.loads(line)
            if "error" in msg:
                err = msg["error"]
                raise OSError(str(err.get("message", err)) if isinstance(err, dict) else str(err))
            result = msg.get("result", {})
            if result.get("canceled"):
                compact = int(result.get("compact_revision", 0) or 0)
                if compact:
                    raise WatchCompacted(
                        f"watch of {prefix}: revisions before {compact} are compacted"
                    )
                raise OSError(f"watch canceled by etcd: {result.get('cancel_reason', '')}")
            for ev in result.get("events", []):
                kv = ev["kv"]
                yield WatchEvent(
                    kind="DELETE" if ev.get("type") == "DELETE" else "PUT",
                    key=base64.b64decode(kv["key"]).decode(errors="replace"),
                    value=base64.b64decode(kv.get("value", "")),
                    revision=int(kv.get("mod_revision", 0)),
                )


def shutdown(resp: requests.Response) -> None:
    """Wake a thread blocked reading ``resp`` (closing the response alone does not)."""
    try:
        fd = resp.raw.fileno()
        s = socket.socket(fileno=os.dup(fd))
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.close()
    except (OSError, ValueError, AttributeError):
        pass  # already closed: nothing blocks on it
    resp.close()
