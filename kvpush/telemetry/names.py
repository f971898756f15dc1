"""Every name telemetry knows: counters, failure kinds, gauges, histograms, peer states.

One vocabulary for the code that bumps the numbers, the live view, ``-o json``, ``probe --stats``
and Prometheus. ``Failure`` doubles as the closed set of *reasons* a push or request fails with:
a reason travels on the wire (``Failure.reason``, ``DecodeRep.reason``) as its string value, with
free-text detail beside it, so failures group by reason. Pure data; no imports beyond enum and
``kvpush.config.Role`` (the keys of the by-role tables).
"""

from __future__ import annotations

from enum import Enum

from kvpush.config import Role


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
    QUARANTINES_LONG = "quarantines_long"  # D: blocks quarantined past QUARANTINE_REPORT_S
    HANDSHAKES_STARTED = "handshakes_started"
    HANDSHAKES_OK = "handshakes_ok"
    HANDSHAKES_FAILED = "handshakes_failed"
    HANDSHAKES_SERVED = "handshakes_served"
    PEERS_EVICTED = "peers_evicted"
    REGISTRY_ERRORS = "registry_errors"  # etcd calls of the registrar that failed
    # Registry hints about a peer this endpoint holds (a leave or a restart in the registry):
    # checked on the peer's side channel; proven (refused, or another incarnation answers) or
    # refuted (the same incarnation answers: kept). docs/reliability.md, "Proof and hints".
    REGISTRY_HINTS = "registry_hints"
    REGISTRY_HINTS_PROVEN = "registry_hints_proven"
    REGISTRY_HINTS_REFUTED = "registry_hints_refuted"
    # Registry events the endpoint's own watch received (layout v2: membership only, so a fleet
    # under steady load sends it none).
    REGISTRY_WATCH_EVENTS = "registry_watch_events"
    # serve-* --prewarm: pairs handshaken before any request; warm-up tries that failed (each
    # tried again with back-off while the peer stays registered).
    PREWARMS = "prewarms"
    PREWARMS_FAILED = "prewarms_failed"
    # restarts and disconnects (docs/reliability.md): a handshake that found a new incarnation
    # at a known address; remote agents of evicted peers removed (before any new one is loaded
    # for that peer); peers moved to degraded by a transport error, and evicted for them.
    PEER_RESTARTS = "peer_restarts"
    STALE_AGENTS_REMOVED = "stale_agents_removed"
    PEERS_DEGRADED = "peers_degraded"
    PEERS_EVICTED_TRANSPORT = "peers_evicted_transport"
    WATCHDOG_STALLS = "watchdog_stalls"  # a watched thread made no progress (runtime.watchdog)


#: Transport errors on an established peer are counted by NIXL status:
#: ``transport_errors_<status in lower case>``, e.g. ``transport_errors_nixl_err_not_found``.
TRANSPORT_ERRORS_PREFIX = "transport_errors_"


def transport_error_counter(status: str) -> str:
    return f"{TRANSPORT_ERRORS_PREFIX}{status.lower()}"


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
    PEER_LEFT = "peer_left"  # the registry says the peer is gone (its key deleted or lapsed)
    PEER_RESTARTED = "peer_restarted"  # a new incarnation at its address (handshake or registry)
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
    BAD_VALUE = "bad_value"  # a field out of range (inf, nan, negative, huge), refused at decode
    # a cap on what peers can make an endpoint hold was reached (docs/reliability.md, "Caps")
    TOO_MANY_WAITS = "too_many_waits"
    TOO_MANY_DECLINED = "too_many_declined"
    TOO_MANY_REGISTRATIONS = "too_many_registrations"
    TOO_MANY_DELAYED = "too_many_delayed"
    TOO_MANY_PEERS = "too_many_peers"
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


class Blame(StrEnum):
    """Whose health a failure kind speaks of, for readiness (``kvpush.telemetry.health``)."""

    OWN = "own"  # the endpoint's own data path: its transport, its memory, its code
    PEER = "peer"  # a peer's or a client's: wrong, unreachable, frozen, gone; bad input; load


#: Every failure kind, once, with whose health it speaks of. Only ``OWN`` kinds count against an
#: endpoint's readiness: a failure a client or a peer caused says nothing about the endpoint,
#: and counting it would let whoever sends such requests (no token needed) take the endpoint out
#: of its Service, where no good request reaches it to undo that. An endpoint's own threads
#: failing is ``/healthz``'s (``RANK_FAILED`` as a reason is then a peer's rank). A test fails
#: when a kind is missing here.
FAILURE_BLAME: dict[Failure, Blame] = {
    # peers and handshakes: the peer a request names is unreachable, wrong, refusing or gone
    Failure.HANDSHAKE_FAILED: Blame.PEER,
    Failure.HANDSHAKE_OVERLOAD: Blame.PEER,  # load: a cap on concurrent handshakes
    Failure.INCOMPATIBLE: Blame.PEER,
    Failure.PREFILL_UNREACHABLE: Blame.PEER,
    Failure.DECODE_UNREACHABLE: Blame.PEER,
    Failure.PREFILL_DEAD: Blame.PEER,
    Failure.PREFILL_FAILED: Blame.PEER,
    Failure.PEER_DEAD: Blame.PEER,
    Failure.SHUTTING_DOWN: Blame.PEER,  # the peer's; its own stop is readiness's "stopping"
    Failure.PEER_LEFT: Blame.PEER,
    Failure.PEER_RESTARTED: Blame.PEER,
    # blocks, leases, registrations: load (a full pool is the routers' to see in pool_free and
    # the registry's load record, not a reason to leave the Service) or what a peer sent
    Failure.NO_FREE_BLOCKS: Blame.PEER,
    Failure.NO_BLOCKS: Blame.PEER,
    Failure.LEASE_EXPIRED: Blame.PEER,
    Failure.REGISTRATION_EXPIRED: Blame.PEER,
    Failure.STALE_REGISTRATION: Blame.PEER,
    Failure.BAD_REGISTRATION: Blame.PEER,
    Failure.BLOCK_COUNT_MISMATCH: Blame.PEER,
    Failure.DUPLICATE_TRANSFER: Blame.PEER,
    Failure.DUPLICATE_REGISTRATION: Blame.PEER,
    Failure.DUPLICATE_REQUEST: Blame.PEER,
    Failure.BAD_REQUEST: Blame.PEER,
    Failure.OVERLOADED: Blame.PEER,
    # WRITEs and fences: a WRITE that failed is the data path's own; one that only did not
    # finish in time, or a fence that failed, says the target is slow, frozen or gone (as
    # ``deadline`` does on D): a frozen peer does not take the other side out of its Service
    Failure.WRITE_POST_FAILED: Blame.OWN,
    Failure.WRITE_ERROR: Blame.OWN,
    Failure.WRITE_TIMEOUT: Blame.PEER,
    Failure.FENCE_FAILED: Blame.PEER,
    # D's side of a request
    Failure.DEADLINE: Blame.PEER,  # P did not push in time: P slow, frozen or never asked
    Failure.CANCELLED: Blame.PEER,
    Failure.VERIFY_FAILED: Blame.OWN,  # bytes landed, wrong
    Failure.UNKNOWN_COMPLETION: Blame.PEER,
    Failure.DUPLICATE_COMPLETION: Blame.PEER,
    Failure.UNEXPECTED_RANK: Blame.PEER,
    Failure.RANK_FAILED: Blame.PEER,  # its own rank's failure is /healthz's
    Failure.CANCEL_UNACKNOWLEDGED: Blame.PEER,
    # input refused
    Failure.AUTH_REJECTED: Blame.PEER,
    Failure.MALFORMED_NOTIF: Blame.PEER,
    Failure.UNEXPECTED_NOTIF: Blame.PEER,
    Failure.FORGED_NOTIF: Blame.PEER,
    Failure.MALFORMED_FRAME: Blame.PEER,
    Failure.OVERSIZED_FRAME: Blame.PEER,
    Failure.BAD_VALUE: Blame.PEER,
    # caps on what peers can make an endpoint hold: load
    Failure.TOO_MANY_WAITS: Blame.PEER,
    Failure.TOO_MANY_DECLINED: Blame.PEER,
    Failure.TOO_MANY_REGISTRATIONS: Blame.PEER,
    Failure.TOO_MANY_DELAYED: Blame.PEER,
    Failure.TOO_MANY_PEERS: Blame.PEER,
    # kvpush itself
    Failure.CALLBACK_ERROR: Blame.OWN,
    Failure.INTERNAL_ERROR: Blame.OWN,
}

#: The failure kinds that count against an endpoint's readiness.
OWN_FAILURES: frozenset[str] = frozenset(
    str(k) for k, blame in FAILURE_BLAME.items() if blame is Blame.OWN
)


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
    # How fragmented the pool is (kvpush.memory.fragmentation.Fragmentation): NIXL merges adjacent
    # blocks into one descriptor, so long runs are what keeps a WRITE cheap.
    POOL_FREE_RUNS = "pool_free_runs"
    POOL_LARGEST_FREE_RUN = "pool_largest_free_run"
    ALLOC_MEAN_RUN_LEN = "alloc_mean_run_len"
    # The fleet registry (with --registry): 1 while etcd answers; 1 once the key is written.
    REGISTRY_UP = "registry_up"
    REGISTRY_REGISTERED = "registry_registered"
    # Remote agents loaded now, and calls towards a removed (stale) agent refused (always 0
    # unless a bug sends through an agent of a peer that restarted).
    REMOTE_AGENTS = "remote_agents"
    STALE_AGENT_USES = "stale_agent_uses"
    THREADS_STALLED = "threads_stalled"  # watched threads without progress now (watchdog)


class Hist(StrEnum):
    PUSH_LATENCY = "push_latency"
    WRITE_DURATION = "write_duration"
    HANDSHAKE_DURATION = "handshake_duration"
    DECODE_LATENCY = "decode_latency"
    # Where a request's time went (``kvpush.telemetry.phases``): one per step between phases.
    PHASE_MATCH_WAIT = "phase_match_wait"  # P: first of blocks finished / PUSH_REG -> matched
    PHASE_HANDSHAKE_WAIT = "phase_handshake_wait"  # P: matched -> P->D handshake done
    PHASE_POST = "phase_post"  # P: handshake done -> last WRITE posted
    PHASE_WRITE = "phase_write"  # P: last WRITE posted -> last WRITE seen done
    PHASE_REGISTER = "phase_register"  # D: blocks allocated -> PUSH_REG sent (incl. handshake)
    PHASE_PUSH_WAIT = "phase_push_wait"  # D: PUSH_REG sent -> last completion received
    PHASE_VERIFY = "phase_verify"  # D: last completion -> bytes verified
    PHASE_ANSWER = "phase_answer"  # D: verified (or completion) -> answer sent


class PeerState(StrEnum):
    """A handshake peer's row in the peer table."""

    CONNECTING = "connecting"
    CONNECTED = "connected"
    DEGRADED = "degraded"  # connected, but its last transport operation(s) failed
    FAILED = "failed"
    DOWN = "down"  # was connected; its process is gone (kvpush.peers.watch), evicted next


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
REQUEST_COUNTERS: dict[Role, tuple[Counter, ...]] = {
    Role.PREFILL: (Counter.PREFILLS,),
    Role.DECODE: (Counter.REQUESTS_OK, Counter.REQUESTS_FAILED),
}
REQUEST_HISTS: dict[Role, tuple[Hist, ...]] = {
    Role.PREFILL: (),
    Role.DECODE: (Hist.DECODE_LATENCY,),
}

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
