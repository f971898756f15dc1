"""Every name telemetry knows: counters, failure kinds, gauges, histograms, peer states.

One vocabulary for the code that bumps the numbers, the live view, ``-o json``, ``probe --stats``
and Prometheus. ``Failure`` doubles as the closed set of *reasons* a push or request fails with:
a reason travels on the wire (``Failure.reason``, ``DecodeRep.reason``) as its string value, with
free-text detail beside it, so failures group by reason. Pure data; no imports beyond enum.
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A ``str`` whose value is its name on the wire and in telemetry (as 3.11's StrEnum)."""

    def __str__(self) -> str:
        return str(self.value)


class Counter(StrEnum):
    PUSHES_OK = "pushes_ok"
    PUSHES_FAILED = "pushes_failed"
    BYTES_PUSHED = "bytes_pushed"
    BYTES_RECEIVED = "bytes_received"
    PREFILLS = "prefills"
    REQUESTS_OK = "requests_ok"
    REQUESTS_FAILED = "requests_failed"
    NOTIFS_RECEIVED = "notifs_received"
    PUSH_REGS_SENT = "push_regs_sent"
    PUSH_REGS_RECEIVED = "push_regs_received"
    HEARTBEATS_SENT = "heartbeats_sent"
    HEARTBEATS_RECEIVED = "heartbeats_received"
    CANCELS_RECEIVED = "cancels_received"
    DECLINES_SENT = "declines_sent"  # told a peer over its side channel: cannot take a transfer
    DECLINES_DROPPED = "declines_dropped"  # ... and could not tell it (its lease bounds it)
    DECLINES_RECEIVED = "declines_received"
    FENCES_SENT = "fences_sent"
    FENCES_OK = "fences_ok"
    FENCES_RECEIVED = "fences_received"
    QUARANTINE_RELEASED = "quarantine_released"
    HANDSHAKES_STARTED = "handshakes_started"
    HANDSHAKES_OK = "handshakes_ok"
    HANDSHAKES_FAILED = "handshakes_failed"
    HANDSHAKES_SERVED = "handshakes_served"
    PEERS_EVICTED = "peers_evicted"
    WATCHDOG_STALLS = "watchdog_stalls"  # a watched thread made no progress (runtime.watchdog)


class Failure(StrEnum):
    """Failure kinds: why a push, a request, a frame or a notification was refused."""

    # peers and handshakes
    HANDSHAKE_FAILED = "handshake_failed"
    HANDSHAKE_OVERLOAD = "handshake_overload"
    INCOMPATIBLE = "incompatible"
    PREFILL_UNREACHABLE = "prefill_unreachable"
    DECODE_UNREACHABLE = "decode_unreachable"
    PREFILL_DEAD = "prefill_dead"
    PREFILL_FAILED = "prefill_failed"  # P failed it for a reason this version does not know
    PEER_DEAD = "peer_dead"
    SHUTTING_DOWN = "shutting_down"
    # blocks, leases, registrations
    NO_FREE_BLOCKS = "no_free_blocks"
    NO_BLOCKS = "no_blocks"
    LEASE_EXPIRED = "lease_expired"
    REGISTRATION_EXPIRED = "registration_expired"
    STALE_REGISTRATION = "stale_registration"
    BAD_REGISTRATION = "bad_registration"
    BLOCK_COUNT_MISMATCH = "block_count_mismatch"
    DUPLICATE_TRANSFER = "duplicate_transfer"
    DUPLICATE_REGISTRATION = "duplicate_registration"
    DUPLICATE_REQUEST = "duplicate_request"
    BAD_REQUEST = "bad_request"
    OVERLOADED = "overloaded"
    # WRITEs and fences
    WRITE_POST_FAILED = "write_post_failed"
    WRITE_ERROR = "write_error"
    WRITE_TIMEOUT = "write_timeout"
    FENCE_FAILED = "fence_failed"
    # D's side of a request
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    VERIFY_FAILED = "verify_failed"
    UNKNOWN_COMPLETION = "unknown_completion"
    DUPLICATE_COMPLETION = "duplicate_completion"  # a P rank completed the same request twice
    UNEXPECTED_RANK = "unexpected_rank"  # a rank that should not write/register for it did
    RANK_FAILED = "rank_failed"  # another tensor-parallel rank of this endpoint failed it
    CANCEL_UNACKNOWLEDGED = "cancel_unacknowledged"
    # input refused
    AUTH_REJECTED = "auth_rejected"
    MALFORMED_NOTIF = "malformed_notif"
    UNEXPECTED_NOTIF = "unexpected_notif"
    FORGED_NOTIF = "forged_notif"
    MALFORMED_FRAME = "malformed_frame"
    OVERSIZED_FRAME = "oversized_frame"
    # kvpush itself
    CALLBACK_ERROR = "callback_error"
    INTERNAL_ERROR = "internal_error"

    @classmethod
    def parse(cls, text: str) -> Failure | None:
        """The kind a peer named, or None for a name this version does not know."""
        try:
            return cls(text)
        except ValueError:
            return None


class Gauge(StrEnum):
    FINISHED_WAITING_REG = "finished_waiting_reg"
    REGS_WAITING_BLOCKS = "regs_waiting_blocks"
    DEFERRED = "deferred"
    INFLIGHT_WRITES = "inflight_writes"
    INBOX_FINISHED = "inbox_finished"
    INBOX_DECODE_NEW = "inbox_decode_new"
    D_WAITING = "d_waiting"
    D_QUARANTINED_REQUESTS = "d_quarantined_requests"
    POOL_FREE = "pool_free"
    POOL_ALLOCATED = "pool_allocated"
    POOL_INFLIGHT = "pool_inflight"
    POOL_QUARANTINED = "pool_quarantined"
    POOL_TOTAL = "pool_total"
    # How fragmented the pool is (kvpush.memory.allocator.Fragmentation): NIXL merges adjacent
    # blocks into one descriptor, so long runs are what keeps a WRITE cheap.
    POOL_FREE_RUNS = "pool_free_runs"
    POOL_LARGEST_FREE_RUN = "pool_largest_free_run"
    ALLOC_MEAN_RUN_LEN = "alloc_mean_run_len"
    THREADS_STALLED = "threads_stalled"  # watched threads without progress now (watchdog)


class Hist(StrEnum):
    PUSH_LATENCY = "push_latency"
    WRITE_DURATION = "write_duration"
    HANDSHAKE_DURATION = "handshake_duration"
    DECODE_LATENCY = "decode_latency"


class PeerState(StrEnum):
    """A handshake peer's row in the peer table."""

    CONNECTING = "connecting"
    CONNECTED = "connected"
    FAILED = "failed"


#: Counters whose per-second rate every snapshot carries (``Snapshot.rates``, same keys).
RATE_COUNTERS: tuple[Counter, ...] = (
    Counter.PUSHES_OK,
    Counter.BYTES_PUSHED,
    Counter.REQUESTS_OK,
    Counter.NOTIFS_RECEIVED,
    Counter.BYTES_RECEIVED,
)

#: What a multi-rank endpoint counts once per request, by role (each of its ranks counts its
#: own share of every request in its own telemetry).
REQUEST_COUNTERS: dict[str, tuple[Counter, ...]] = {
    "prefill": (Counter.PREFILLS,),
    "decode": (Counter.REQUESTS_OK, Counter.REQUESTS_FAILED),
}
REQUEST_HISTS: dict[str, tuple[Hist, ...]] = {"prefill": (), "decode": (Hist.DECODE_LATENCY,)}

#: Gauges that are queue depths, with the words the live view shows for them.
QUEUE_GAUGES: dict[Gauge, str] = {
    Gauge.FINISHED_WAITING_REG: "finished awaiting PUSH_REG",
    Gauge.REGS_WAITING_BLOCKS: "registrations awaiting blocks",
    Gauge.DEFERRED: "deferred pushes",
    Gauge.INFLIGHT_WRITES: "in-flight WRITEs",
    Gauge.D_WAITING: "D requests waiting",
}

#: Gauges that describe the block pool; ``pool_total`` is its capacity.
POOL_GAUGES: tuple[Gauge, ...] = (
    Gauge.POOL_FREE,
    Gauge.POOL_ALLOCATED,
    Gauge.POOL_INFLIGHT,
    Gauge.POOL_QUARANTINED,
    Gauge.POOL_TOTAL,
)
