"""``Access.of_credentials``: an etcd access built from anything holding ``Credentials`` (a
``RegistryConfig``), the same as ``Access.of`` given each field."""

from __future__ import annotations

import pytest

from kvpush.errors import ConfigError
from kvpush.fleet.config import Access, Credentials, RegistryConfig


def test_the_access_of_credentials_is_access_of_each_field() -> None:
    creds = Credentials(
        user="root", password="pw", ca_cert="/ca.pem", cert="/c.pem", key="/k.pem", timeout_s=4.5
    )
    got = Access.of_credentials("e1:2379,https://e2", creds)
    assert got == Access.of(
        "e1:2379,https://e2",
        user="root",
        password="pw",
        ca_cert="/ca.pem",
        cert="/c.pem",
        key="/k.pem",
        timeout_s=4.5,
    )
    assert got.urls == ("http://e1:2379", "https://e2:2379")
    assert Access.of_credentials("e1", Credentials()) == Access.of("e1")


def test_a_registry_config_s_access_holds_its_credentials() -> None:
    cfg = RegistryConfig(urls="http://e:2379", user="u", password="pw-secret", timeout_s=3.0)
    assert cfg.access == Access.of("http://e:2379", user="u", password="pw-secret", timeout_s=3.0)
    assert "pw-secret" not in repr(cfg.access)


def test_the_access_of_credentials_checks_the_pairs() -> None:
    with pytest.raises(ConfigError, match="needs its key"):
        Access.of_credentials("e1", Credentials(cert="/c.pem"))
    with pytest.raises(ConfigError, match="user and a password"):
        Access.of_credentials("e1", Credentials(user="u"))
    with pytest.raises(ConfigError, match="invalid etcd URL"):
        Access.of_credentials("http://e1/x", Credentials())
