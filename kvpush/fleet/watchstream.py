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
from typing import Literal

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client

from kvpush.errors import WatchCompacted


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix. ``value`` is empty for a DELETE."""

    kind: Literal["PUT", "DELETE"]
    key: str
    value: bytes
    revision: int  # the etcd revision of this change (the key's mod_revision)


def open_stream(
    c: Etcd3Client, create: dict[str, str], timeout_s: float, ca: str | None
) -> requests.Response:
    """Open a watch (``create``: etcd's create_request) on a session of its own, with ``c``'s
    credentials; ``ca``: the CA bundle's path to verify etcd with (None: the session's way).
    Errors are etcd3gw's, so ``Etcd`` fails over as for every other call."""
    s = requests.Session()
    s.verify = c.session.verify  # for the record: requests prefers the environment's
    s.cert = c.session.cert
    s.headers.update(c.session.headers)
    try:
        # connect bounded; reads unbounded (a quiet cluster sends nothing for hours)
        r = s.post(
            c.get_url("/watch"),
            json={"create_request": create},
            stream=True,
            timeout=(timeout_s, None),
            verify=ca,
        )
    except requests.exceptions.Timeout as e:
        s.close()
        raise etcd_exc.ConnectionTimeoutError(str(e)) from None
    except requests.exceptions.ConnectionError as e:
        s.close()
        raise etcd_exc.ConnectionFailedError(str(e)) from None
    if r.status_code != 200:
        text = r.text
        s.close()
        if r.status_code == 503:
            raise etcd_exc.ConnectionFailedError(text)
        raise etcd_exc.Etcd3Exception(text, r.reason)
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
