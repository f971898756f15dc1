"""P's per-peer lane facts: which lane carries each D rank's KV, and what posting costs there.

``PeerLanes`` keeps, per D rank P writes to (a ``PeerKey``): the wall time of its first WRITE
post, descriptors per push (last and mean), the time spent in NIXL's prep+post calls per push
(``make_prepped_xfer`` + ``transfer``: ``Legs.post`` times them) and, for WRITEs still in flight
after their post, how much of the WRITE's time (post to seen done) the post took. Posting is the
transfer for a WRITE that completes inside its post (shared memory: ``cma`` copies there): those
are left out of that share. Each peer agent's first contact (its first notification, or the
first WRITE to it) goes to the rank's ``LaneBook`` (``kvpush.transport.lanes``), which attributes
UCX's protocol tables to peers.

``fields`` is the rank's telemetry hook (``Telemetry.peer_extras_fn``): per peer row, ``lane``
(the lane, the posting figures, the evidence) and ``lane_flags``:

- ``tcp_on_one_host``: the WRITE goes over ``tcp`` between two endpoints on one host (UCX says
  intra-node, or the peer's address is this host's);
- ``post_dominates``: posting took more than half of the WRITE's time (over at least
  ``MIN_ASYNC`` WRITEs that were still in flight after their post).

Threads: ``heard``, ``posted`` and ``done`` on the writer's owner thread (a few attribute
updates each); ``fields`` on the snapshot's thread (it reads the UCX log, off the hot path).
Counters read across threads may be one push apart: figures, not accounting.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Final

from kvpush.peers.state import PeerKey, peer_name
from kvpush.transport.lanes import Lane, LaneBook

TCP_ON_ONE_HOST: Final = "tcp_on_one_host"
POST_DOMINATES: Final = "post_dominates"
#: WRITEs in flight after their post needed before ``post_dominates`` is judged.
MIN_ASYNC: Final = 3
_MAX_PEERS = 4096


class _Posts:
    """One D rank's posting figures (written by the owner thread only)."""

    __slots__ = (
        "agent",
        "async_n",
        "async_post_s",
        "async_write_s",
        "bytes_last",
        "descs_last",
        "descs_sum",
        "first_write",
        "post_s_sum",
        "pushes",
    )

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.first_write = time.time()
        self.pushes = 0
        self.descs_last = 0
        self.descs_sum = 0
        self.bytes_last = 0
        self.post_s_sum = 0.0
        self.async_n = 0
        self.async_post_s = 0.0
        self.async_write_s = 0.0


class PeerLanes:
    def __init__(self, book: LaneBook, local_host: str) -> None:
        self._book = book
        self._posts: dict[PeerKey, _Posts] = {}
        self._here = {local_host, "localhost", socket.gethostname()}

    # -- the owner thread
    def heard(self, agent: str) -> None:
        """A notification from the peer agent ``agent`` (its first is its first contact)."""
        self._book.contact(agent)

    def posted(self, key: PeerKey, agent: str, descs: int, nbytes: int, post_s: float) -> None:
        """One WRITE leg to ``key`` was posted: ``descs`` descriptors, ``post_s`` in NIXL."""
        p = self._posts.get(key)
        if p is None or p.agent != agent:  # a new peer, or a new incarnation at its address
            if p is None and len(self._posts) >= _MAX_PEERS:
                self._posts.pop(next(iter(self._posts)))
            p = self._posts[key] = _Posts(agent)
            self._book.contact(agent, p.first_write)
        p.pushes += 1
        p.descs_last = descs
        p.descs_sum += descs
        p.bytes_last = nbytes
        p.post_s_sum += post_s

    def done(self, key: PeerKey, post_s: float, write_s: float) -> None:
        """A WRITE to ``key`` that was still in flight after its post completed."""
        p = self._posts.get(key)
        if p is not None:
            p.async_n += 1
            p.async_post_s += post_s
            p.async_write_s += write_s

    # -- the snapshot's thread
    def fields(self) -> dict[str, dict[str, object]]:
        """``lane`` and ``lane_flags`` by peer row name (``Telemetry.peer_extras_fn``)."""
        posts = list(self._posts.copy().items())  # (dict.copy: atomic under the GIL)
        asked: dict[str, tuple[str | None, int | None]] = {}
        for key, p in posts:
            desc = p.bytes_last // p.descs_last if p.descs_last else None
            asked[p.agent] = ("intra-node" if self._same_host(key[0]) else "inter-node", desc)
        lanes = self._book.lanes(asked)
        out: dict[str, dict[str, object]] = {}
        for key, p in posts:
            lane = lanes.get(p.agent) or Lane(evidence="unknown: not read yet")
            same = lane.locality == "intra-node" if lane.locality else self._same_host(key[0])
            row = {**lane.as_dict(), **_figures(p)}
            out[peer_name(key)] = {"lane": row, "lane_flags": flags(lane, same, p)}
        return out

    def _same_host(self, host: str) -> bool:
        if host in self._here:
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def _figures(p: _Posts) -> dict[str, object]:
    n = max(p.pushes, 1)
    return {
        "pushes": p.pushes,
        "first_write": round(p.first_write, 6),
        "descs_per_push": p.descs_last,
        "descs_mean": round(p.descs_sum / n, 3),
        "post_us_mean": round(p.post_s_sum / n * 1e6, 3),
        "post_us_per_desc": round(p.post_s_sum / p.descs_sum * 1e6, 4) if p.descs_sum else None,
        "post_share": round(p.async_post_s / p.async_write_s, 4) if p.async_write_s > 0 else None,
        "writes_in_flight_after_post": p.async_n,
    }


def flags(lane: Lane, same_host: bool, p: _Posts) -> list[str]:
    """What an operator should not see on this peer's lane."""
    out: list[str] = []
    if "tcp" in lane.write and same_host:
        out.append(TCP_ON_ONE_HOST)
    if p.async_n >= MIN_ASYNC and p.async_write_s > 0 and p.async_post_s > 0.5 * p.async_write_s:
        out.append(POST_DOMINATES)
    return out
