"""A real etcd server speaking TLS with client-certificate authentication, for the tests of
``--registry-ca/--registry-cert/--registry-key``: a throw-away CA, a server certificate for
127.0.0.1 and a client certificate, made with the ``openssl`` command line tool."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.etcd import EtcdServer


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def openssl_missing() -> str | None:
    return None if shutil.which("openssl") else "no openssl command to make test certificates"


def _ssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> Pki:
    """A CA, a server certificate (SAN 127.0.0.1, localhost) and a client certificate."""
    d.mkdir(parents=True, exist_ok=True)
    _ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "2", "-subj", "/CN=kvpush-test-ca", cwd=d)  # fmt: skip
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.csr", "-subj", f"/CN=kvpush-test-{name}", cwd=d)  # fmt: skip
        _ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=d)  # fmt: skip
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


class TlsEtcdServer(EtcdServer):
    """``EtcdServer`` on https client URLs that demands a client certificate signed by the CA."""

    scheme = "https"

    def __init__(self, data_dir: Path, pki: Pki) -> None:
        super().__init__(data_dir)
        self.pki = pki

    def _cmd(self) -> list[str]:
        p = self.pki
        return [
            *super()._cmd(),
            "--cert-file", str(p.server_cert), "--key-file", str(p.server_key),
            "--client-cert-auth", "--trusted-ca-file", str(p.ca),
        ]  # fmt: skip

    def healthy(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca))
        ctx.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        try:
            health = self._client_url() + "/health"
            with urllib.request.urlopen(health, timeout=1, context=ctx) as r:
                return b'"health":"true"' in r.read()
        except (OSError, ValueError):
            return False
