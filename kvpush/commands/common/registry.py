"""Where the fleet tools read the registry: the etcd client from the registry options, the listing.

Owns ``RegistrySource`` (the registry options of a fleet-aware command, frozen: URLs, cluster,
credentials) with ``open`` (an ``kvpush.fleet.etcd.Etcd`` client; the password read from its
file here, kept in the client only) and ``list`` (the cluster's records, or
``RegistryUnavailable`` -- exit 69 -- with a hint naming the URLs tried), and
``registry_source`` (one from a command's parsed registry options). Runs on the caller's
thread; the etcd client is imported on use (``import kvpush.cli`` loads none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush.errors import ConfigError, RegistryUnavailable
from kvpush.fleet.config import check_file, read_password_file
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

    def open(self) -> Etcd:
        """A client (the password read from its file here, kept in the client only)."""
        from kvpush.fleet.etcd import Etcd

        if (self.user is None) != (self.password_file is None):
            raise ConfigError(
                "etcd authentication needs --registry-user and --registry-password-file together",
                "give both, or neither",
            )
        return Etcd(
            self.urls,
            user=self.user,
            password=read_password_file(self.password_file) if self.password_file else None,
            ca_cert=check_file("--registry-ca", self.ca),
            cert=check_file("--registry-cert", self.cert),
            key=check_file("--registry-key", self.key),
            timeout_s=self.timeout_s,
        )

    def list(self, etcd: Etcd | None = None) -> list[EndpointRecord]:
        """Every endpoint registered in the cluster (sorted by address)."""
        from kvpush.fleet.store import list_endpoints

        client = etcd if etcd is not None else self.open()
        try:
            records, _ = list_endpoints(client, self.cluster)
        except RegistryUnavailable as e:
            raise RegistryUnavailable(e.message, unreachable_hint(self.urls)) from None
        return records


def unreachable_hint(urls: str) -> str:
    return (
        f"is etcd running and reachable at {urls}? check --registry (or KVPUSH_REGISTRY): "
        "etcd's client URLs, e.g. http://10.0.0.5:2379,http://10.0.0.6:2379"
    )


def registry_source(p: Mapping[str, Any]) -> RegistrySource:
    """The registry of a command's parsed options (``options.REGISTRY``: drive's and fleet's)."""
    return RegistrySource(
        urls=p.get("registry") or "",
        cluster=p.get("cluster") or "default",
        user=p.get("registry_user"),
        password_file=p.get("registry_password_file"),
        ca=p.get("registry_ca"),
        cert=p.get("registry_cert"),
        key=p.get("registry_key"),
    )
