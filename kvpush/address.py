"""Addresses: ``HOST:PORT`` parsed and printed one way everywhere (IPv6 in brackets), and which
spellings bind every interface. Pure; any thread.
"""

from __future__ import annotations

import ipaddress
import socket

from kvpush.errors import ConfigError


def binds_all_interfaces(host: str) -> bool:
    """True for every spelling of the unspecified address (0.0.0.0, ::, [::], 0, *)."""
    h = host.strip().strip("[]")
    if h in ("*", ""):
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        try:
            return ipaddress.ip_address(socket.inet_ntoa(socket.inet_aton(h))).is_unspecified
        except OSError:
            return False


def parse_address(addr: str, default_port: int | None = None) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (or ``[V6]:PORT``, or ``HOST`` with a default port)."""
    text = addr.strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://") :]
    host, sep, port_s = text.rpartition(":")
    if text.startswith("[") and "]" in text:
        close = text.index("]")
        host = text[1:close]
        rest = text[close + 1 :]
        sep, port_s = (":", rest[1:]) if rest.startswith(":") else ("", "")
    elif not sep:
        host, port_s = text, ""
    if not host or any(c.isspace() for c in host) or "/" in host:
        raise ConfigError(f"invalid address {addr!r}", "use HOST:PORT, e.g. 127.0.0.1:5600")
    if not port_s:
        if default_port is None:
            raise ConfigError(f"address {addr!r} has no port", "use HOST:PORT, e.g. 127.0.0.1:5600")
        return host, default_port
    if not port_s.isdigit() or not (1 <= int(port_s) <= 65535):
        raise ConfigError(f"invalid port in address {addr!r}", "ports are 1-65535")
    return host, int(port_s)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
