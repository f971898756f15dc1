"""Where the fleet tools read the registry: the etcd client from the registry options, the listing.

Owns ``RegistrySource`` (the registry options of a fleet-aware command, frozen: URLs, cluster,
credentials) with ``open`` (the process's one ``kvpush.fleet.etcd.Etcd`` client, built once from
one ``kvpush.fleet.config.Access``: the URLs parsed and the credentials checked there, the
password read from its file here and kept in the client only; every later ``open`` returns the
same client), ``list`` (the cluster's records -- membership joined with load summaries, or
membership alone -- or ``RegistryUnavailable``, exit 69, with a hint naming the URLs tried) and
``v1_note`` (a warning when endpoints of an older kvpush are registered under layout v1, which
this kvpush does not read), and ``registry_source`` (one from a command's parsed registry
options). Runs on the caller's thread; the etcd client is imported on use (``import kvpush.cli``
loads none).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush.errors import ConfigError, RegistryUnavailable
from kvpush.fleet.config import Access, check_file, read_password_file
from kvpush.fleet.record import EndpointRecord, check_cluster

if TYPE_CHECKING:
    from kvpush.fleet.etcd import Etcd

#: A fleet tool's deadline for one etcd request (per URL).
REQUEST_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RegistrySource:
    urls: str
    cluster: str = "default"
    user: str | None = None
    password_file: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    timeout_s: float = REQUEST_TIMEOUT_S
    # The one client, once opened (a list: the dataclass is frozen).
    _client: list[Etcd] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError(
                "no registry given",
                "pass --registry http://HOST:2379 (etcd's client URL) or set KVPUSH_REGISTRY",
            )
        try:
            check_cluster(self.cluster)
        except ValueError as e:
            raise ConfigError(str(e), "pass --cluster NAME") from None

    def access(self) -> Access:
        """How to reach etcd (URLs parsed, credentials checked, the password file read)."""
        return Access.of(
            self.urls,
            user=self.user,
            password=read_password_file(self.password_file) if self.password_file else None,
            ca_cert=check_file("--registry-ca", self.ca),
            cert=check_file("--registry-cert", self.cert),
            key=check_file("--registry-key", self.key),
            timeout_s=self.timeout_s,
        )

    def open(self) -> Etcd:
        """The process's client of this registry (built at the first call, then the same)."""
        from kvpush.fleet.etcd import Etcd

        with _clients_lock:
            if not self._client:
                self._client.append(Etcd(self.access()))
            return self._client[0]

    def list(self, etcd: Etcd | None = None, load: bool = True) -> list[EndpointRecord]:
        """Every endpoint registered in the cluster (sorted by address), each with its load
        summary unless ``load`` is False (membership alone: one smaller range)."""
        from kvpush.fleet.store import list_endpoints

        client = etcd if etcd is not None else self.open()
        try:
            records, _ = list_endpoints(client, self.cluster, load)
        except RegistryUnavailable as e:
            raise RegistryUnavailable(e.message, unreachable_hint(self.urls)) from None
        return records

    def v1_note(self, etcd: Etcd | None = None) -> str:
        """A warning when endpoints of an older kvpush are registered in this cluster under
        layout v1 (``/kvpush/v1/``, which this kvpush neither reads nor writes); "" otherwise,
        and when etcd does not say."""
        from kvpush.errors import RegistryError
        from kvpush.fleet.record import v1_prefix
        from kvpush.fleet.store import count_v1

        try:
            n = count_v1(etcd if etcd is not None else self.open(), self.cluster)
        except (RegistryUnavailable, RegistryError):
            return ""
        if not n:
            return ""
        return (
            f"{n} endpoint(s) of cluster {self.cluster!r} are registered by an older kvpush "
            f"under {v1_prefix(self.cluster)} (layout v1), which this kvpush does not read: "
            "upgrade them to see them here"
        )


_clients_lock = threading.Lock()


def unreachable_hint(urls: str) -> str:
    return (
        f"is etcd running and reachable at {urls}? check --registry (or KVPUSH_REGISTRY): "
        "etcd's client URLs, e.g. http://10.0.0.5:2379,http://10.0.0.6:2379"
    )


def registry_source(p: Mapping[str, object]) -> RegistrySource:
    """The registry of a command's parsed options (``options.REGISTRY``: drive's and fleet's)."""

    def text(name: str) -> str | None:  # each of these options is a text, or unset
        v = p.get(name)
        return None if v is None else str(v)

    return RegistrySource(
        urls=text("registry") or "",
        cluster=text("cluster") or "default",
        user=text("registry_user"),
        password_file=text("registry_password_file"),
        ca=text("registry_ca"),
        cert=text("registry_cert"),
        key=text("registry_key"),
    )
