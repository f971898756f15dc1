"""How an endpoint (or a tool) reaches the registry: ``Access`` and ``RegistryConfig``, frozen,
checked once.

Owns the registry settings an operator gives and their checks, in one place: ``Access`` is how
to reach etcd -- the client URLs, parsed here once (``parse_urls``), the credentials (a user
needs its password, a client certificate its key), the per-call deadline -- and every etcd client
(``kvpush.fleet.etcd.Etcd``) is built from one. ``RegistryConfig`` is an endpoint's registration
(cluster, lease TTL, load period, leave grace, the address to advertise) with its ``access``.
Both take the credentials' fields from ``Credentials`` (``CredentialArgs``: the same as keyword
arguments, for ``Access.of`` and ``Etcd``).
A password file must be private (no access for other users, the rule of ``--auth-token-file``:
both are read by ``kvpush.wire.auth.read_secret_file``), TLS files must exist, a TTL leaves room
for three refreshes. The password is held with ``repr=False``: it never reaches a log line, a
``repr`` or an error message. Pure values and file reads; no etcd client is imported here
(``import kvpush.cli`` stays light).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TypedDict, Unpack
from urllib.parse import urlsplit

from kvpush.errors import ConfigError
from kvpush.fleet.record import check_cluster
from kvpush.wire.auth import SecretFileWords, read_secret_file

DEFAULT_TTL_S = 10
MIN_TTL_S = 2
LOAD_PERIOD_S = 2.0  # the load summary is re-read this often, written when it changed
LOAD_REFRESH_PERIODS = 5  # ... and at least every this many periods
TIMEOUT_S = 2.0  # one etcd call
LEAVE_GRACE_S = 1.0  # a graceful stop serves on this long after its key went, then drains
DEFAULT_PORT = 2379


def parse_urls(spec: str | Sequence[str]) -> list[str]:
    """The client URLs in ``spec`` (a comma-separated string or a list), normalised to
    ``scheme://host:port``; ConfigError naming the bad one."""
    items = spec.split(",") if isinstance(spec, str) else [u for s in spec for u in s.split(",")]
    urls: list[str] = []
    for raw in (s.strip() for s in items):
        if not raw:
            continue
        text = raw if "://" in raw else "http://" + raw
        u = urlsplit(text)
        try:
            port = u.port or DEFAULT_PORT
        except ValueError:
            port = -1
        if (
            u.scheme not in ("http", "https")
            or not u.hostname
            or port <= 0
            or u.path not in ("", "/")
        ):
            raise ConfigError(
                f"invalid etcd URL {raw!r}",
                "give etcd client URLs as http://HOST:PORT or https://HOST:PORT, comma-separated",
            )
        host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
        urls.append(f"{u.scheme}://{host}:{port}")
    if not urls:
        raise ConfigError(
            "no etcd URL given", "give --registry http://HOST:2379[,http://HOST2:2379]"
        )
    return urls


@dataclass(frozen=True, kw_only=True)
class Credentials:
    """Who calls etcd, and how: the user and its password, the TLS files, one call's deadline
    (keyword-only). ``Access`` checks the pairs; ``RegistryConfig`` builds its ``Access`` from
    them."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    timeout_s: float = TIMEOUT_S


class CredentialArgs(TypedDict, total=False):
    """``Credentials``' fields as keyword arguments (``Access.of``, ``Etcd``)."""

    user: str | None
    password: str | None
    ca_cert: str | None
    cert: str | None
    key: str | None
    timeout_s: float


@dataclass(frozen=True)
class Access(Credentials):
    """How to reach etcd: the client URLs (parsed), the credentials, one call's deadline.
    Build one with ``Access.of`` or ``Access.of_credentials`` (which parse the URLs); the pairs
    are checked here."""

    urls: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError(
                "no etcd URL given", "give --registry http://HOST:2379[,http://HOST2:2379]"
            )
        if (self.cert is None) != (self.key is None):
            raise ConfigError(
                "a TLS client certificate needs its key (and the key its certificate)",
                "give both --registry-cert and --registry-key",
            )
        if (self.user is None) != (self.password is None):
            raise ConfigError(
                "etcd authentication needs a user and a password",
                "give both --registry-user and --registry-password-file, or neither",
            )

    @staticmethod
    def of(spec: str | Sequence[str], **creds: Unpack[CredentialArgs]) -> Access:
        """The access to the etcd at ``spec`` (comma-separated URLs, or a list of them) with
        ``creds`` (``Credentials``' fields, each optional)."""
        return Access(tuple(parse_urls(spec)), **creds)

    @staticmethod
    def of_credentials(spec: str | Sequence[str], creds: Credentials) -> Access:
        """The access to the etcd at ``spec`` with the credentials ``creds`` holds (e.g. a
        ``RegistryConfig``'s)."""
        given = {f.name: getattr(creds, f.name) for f in fields(Credentials)}
        return Access(tuple(parse_urls(spec)), **given)


@dataclass(frozen=True)
class RegistryConfig(Credentials):
    """Where and how to register (the credentials keyword-only); ``access`` is built (the URLs
    parsed, the pairs checked) once, here."""

    urls: str
    cluster: str = "default"
    ttl_s: int = DEFAULT_TTL_S
    advertise: str | None = None  # the host peers and routers use (the key's address)
    load_period_s: float = LOAD_PERIOD_S
    leave_grace_s: float = LEAVE_GRACE_S
    access: Access = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "access", Access.of_credentials(self.urls, self))
        try:
            check_cluster(self.cluster)
        except ValueError as e:
            raise ConfigError(f"--cluster: {e}", "e.g. --cluster prod-a") from None
        if not 0 <= self.leave_grace_s <= 300:
            raise ConfigError(
                f"--registry-leave-grace must be 0-300 seconds, got {self.leave_grace_s:g}",
                "give the seconds routers need to see a key go (default 1; 0: drain at once)",
            )
        if not self.load_period_s > 0:
            raise ConfigError(
                f"--registry-load-period must be positive, got {self.load_period_s:g}",
                "give the seconds between two readings of the load summary, e.g. 2",
            )
        if self.ttl_s < MIN_TTL_S:
            raise ConfigError(
                f"--registry-ttl must be at least {MIN_TTL_S} s, got {self.ttl_s}",
                "the lease is refreshed every TTL/3: give 10 (the default) or more",
            )

    @property
    def refresh_s(self) -> float:
        return self.ttl_s / 3


_FLAG = "--registry-password-file"
_PASSWORD_FILE = SecretFileWords(
    missing=(f"{_FLAG} {{path}}: {{strerror}}", "check the path and its permissions"),
    not_regular=(f"{_FLAG} {{path}} is not a regular file", "give the path of a file"),
    # the rule of --auth-token-file
    loose=(
        f"{_FLAG} {{path}} is readable by other users (mode {{mode:03o}})",
        "restrict it to its owner: chmod 600 {path}",
    ),
    unreadable=(
        f"{_FLAG} {{path}} cannot be read as UTF-8 text: {{error}}",
        "put the password on one line of a UTF-8 file",
    ),
)


def read_password_file(path: str) -> str:
    """The password in ``path`` (one line, trailing newline dropped); refused unless the file
    is readable by its owner only. The message names the file, never its content."""
    raw = read_secret_file(path, _PASSWORD_FILE)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _PASSWORD_FILE.error(_PASSWORD_FILE.unreadable, path, e) from None
    password = text.rstrip("\r\n")
    # a lone "\r" breaks a line too (what reading the file as text made of it)
    if not password or "\n" in password or "\r" in password:
        raise ConfigError(
            f"{_FLAG} {path} must hold the password on exactly one line",
            "write it with: printf '%s' \"$PASSWORD\" > FILE; chmod 600 FILE",
        )
    return password


def check_file(flag: str, path: str | None) -> str | None:
    """``path`` if it names a readable file (TLS material), else a ConfigError naming ``flag``."""
    if path is None:
        return None
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ConfigError(f"{flag} {path}: no readable file there", "check the path")
    return path
