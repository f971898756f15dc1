"""Where ``fleet ls``/``watch``/``check`` find the fleet: the registry, a listing, or both.

Owns ``FleetSource``: the registry (``kvpush.commands.common.registry.RegistrySource``, optional)
and the endpoints listed with ``--endpoints FILE|-`` and ``--peer`` (``kvpush.commands.fleet
.entries``), seen ``concurrency`` at a time (``kvpush.commands.fleet.sight``). ``list`` returns
one record per address -- a registered endpoint's record when it is also listed (its load
summary is the registry's), otherwise what the listed endpoint said itself -- and the problem
lines of the listing, of the endpoints that could not be seen, and of endpoints an older kvpush
registered under layout v1 (which this one does not read). The registry is read through the
process's one etcd client (``RegistrySource.open``). ``fleet_source`` builds one
from a command's options and refuses, with a hint, a command that names no fleet at all.
Runs on the caller's thread (and ``sight``'s short-lived contact pool).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush.commands.common.registry import RegistrySource, registry_source
from kvpush.commands.fleet.entries import Listing, read_entries
from kvpush.commands.fleet.sight import CONTACT_TIMEOUT_S, sight_all
from kvpush.errors import ConfigError
from kvpush.fleet.record import EndpointRecord

if TYPE_CHECKING:
    from kvpush.fleet.etcd import Etcd


@dataclass(frozen=True)
class Listed:
    """One listing of the fleet: its records (by address) and what could not be listed."""

    records: list[EndpointRecord]
    problems: list[str] = field(default_factory=list)
    registered: dict[str, EndpointRecord] = field(default_factory=dict)  # the registry's
    unseen: int = 0  # listed endpoints that could not be seen (unreachable, not a peer...)
    engines: int = 0  # vLLM engines among the records (listed only)


@dataclass(frozen=True)
class FleetSource:
    registry: RegistrySource | None
    listing: Listing
    token: bytes | None = None
    concurrency: int = 8
    timeout_s: float = CONTACT_TIMEOUT_S

    @property
    def cluster(self) -> str:
        """How the views name this fleet."""
        if self.registry is None:
            return "listed"
        return self.registry.cluster + (" + listed" if self.listing.entries else "")

    def open(self) -> Etcd | None:
        return self.registry.open() if self.registry is not None else None

    def list(self, etcd: Etcd | None = None) -> Listed:
        """Every endpoint, registered or listed, one record per address (sorted)."""
        by_addr: dict[str, EndpointRecord] = {}
        problems = list(self.listing.problems)
        if self.registry is not None:
            by_addr = {r.address: r for r in self.registry.list(etcd)}
            note = self.registry.v1_note(etcd)
            if note:
                problems.append(note)
        registered = dict(by_addr)
        todo = [e for e in self.listing.entries if e.address not in by_addr]
        unseen = engines = 0
        for seen in sight_all(todo, self.token, self.concurrency, self.timeout_s):
            if seen.problem:
                problems.append(seen.problem)
            if seen.record is None:
                unseen += 1
                continue
            engines += seen.kind == "vllm"
            by_addr[seen.record.address] = seen.record
        records = [by_addr[a] for a in sorted(by_addr)]
        return Listed(records, problems, registered, unseen, engines)


def fleet_source(
    p: Mapping[str, object],
    endpoints: Sequence[str],
    peers: Sequence[str],
    concurrency: int,
    token: bytes | None = None,
) -> FleetSource:
    """The fleet a command's options name: ``--registry`` (or KVPUSH_REGISTRY), ``--endpoints``
    files, ``--peer`` values, any of them together."""
    listing = read_entries(endpoints, peers)
    registry = registry_source(p) if p.get("registry") or not (endpoints or peers) else None
    if registry is None and not listing.entries:
        raise ConfigError(
            "no endpoint to look at: "
            + ("; ".join(listing.problems) if listing.problems else "the listing is empty"),
            "list endpoints as 'HOST:PORT [prefill|decode] [tp=N]', one per line, or pass "
            "--peer HOST:PORT=ROLE or --registry URL",
        )
    return FleetSource(registry, listing, token, concurrency)
