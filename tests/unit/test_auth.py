"""Message authentication (HMAC over channel, timestamp, nonce, body) and token files."""

from __future__ import annotations

import contextlib
import os
import threading
import types
from pathlib import Path

import pytest

from kvpush.errors import AuthError, ConfigError
from kvpush.wire import auth as auth_mod
from kvpush.wire import protocol
from kvpush.wire.auth import CH_NOTIF, CH_REPLY, CH_REQUEST, Authenticator, load_token_file

TOKEN = b"0123456789abcdef0123456789abcdef"


def env_of(sealed: bytes) -> protocol.Envelope:
    return protocol.decode_envelope(
        protocol.MAGIC_REQ + sealed, protocol.MAGIC_REQ, 1 << 20, "test"
    )


def at(monkeypatch: pytest.MonkeyPatch, t: float) -> None:
    """Freeze kvpush.wire.auth's wall clock (and only its) at ``t``."""
    monkeypatch.setattr(auth_mod, "time", types.SimpleNamespace(time=lambda: t))


def test_seal_and_open() -> None:
    a, b = Authenticator(TOKEN), Authenticator(TOKEN)
    assert a.enabled
    env = env_of(a.seal(CH_REQUEST, b"hello"))
    assert len(env.tag) == 32 and len(env.nonce) == 16
    assert b.open(CH_REQUEST, env) == b"hello"


def test_without_a_token_everything_passes() -> None:
    a = Authenticator(None)
    assert not a.enabled
    env = env_of(a.seal(CH_REQUEST, b"x"))
    assert env.tag == b"" and env.nonce == b""
    assert a.open(CH_REQUEST, env) == b"x"
    assert a.open(CH_REQUEST, env) == b"x"  # no replay tracking without a token


def test_missing_tag() -> None:
    env = env_of(Authenticator(None).seal(CH_REQUEST, b"x"))
    with pytest.raises(AuthError, match=r"^message has no authentication tag$") as ei:
        Authenticator(TOKEN).open(CH_REQUEST, env)
    assert ei.value.hint == "both sides must use the same --auth-token-file"


@pytest.mark.parametrize("tamper", ["body", "ts", "nonce", "channel", "token"])
def test_bad_tag(tamper: str) -> None:
    a = Authenticator(TOKEN)
    env = env_of(a.seal(CH_REQUEST, b"payload"))
    opener, channel = Authenticator(TOKEN), CH_REQUEST
    if tamper == "body":
        env = protocol.Envelope(v=env.v, ts=env.ts, nonce=env.nonce, body=b"pAyload", tag=env.tag)
    elif tamper == "ts":
        env = protocol.Envelope(
            v=env.v, ts=env.ts + 1e-6, nonce=env.nonce, body=env.body, tag=env.tag
        )
    elif tamper == "nonce":
        env = protocol.Envelope(v=env.v, ts=env.ts, nonce=b"\x00" * 16, body=env.body, tag=env.tag)
    elif tamper == "channel":
        channel = CH_NOTIF  # a request replayed as a notification
    else:
        opener = Authenticator(b"another token, also long enough")
    with pytest.raises(AuthError, match=r"^message has a bad authentication tag$"):
        opener.open(channel, env)


def test_reply_is_bound_to_its_request_nonce() -> None:
    a = Authenticator(TOKEN)
    env = env_of(a.seal(CH_REPLY + b"n1", b"rep"))
    with pytest.raises(AuthError, match="bad authentication tag"):
        Authenticator(TOKEN).open(CH_REPLY + b"n2", env)
    assert Authenticator(TOKEN).open(CH_REPLY + b"n1", env) == b"rep"


def test_replay_rejected() -> None:
    a, b = Authenticator(TOKEN), Authenticator(TOKEN)
    env = env_of(a.seal(CH_NOTIF, b"x"))
    assert b.open(CH_NOTIF, env) == b"x"
    with pytest.raises(AuthError, match=r"^replayed message \(nonce seen before\)$"):
        b.open(CH_NOTIF, env)


@pytest.mark.parametrize("skew", [-61.0, 61.0])
def test_stale_or_future_timestamp_rejected(monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    a, b = Authenticator(TOKEN), Authenticator(TOKEN)
    at(monkeypatch, 1_000_000.0)
    env = env_of(a.seal(CH_REQUEST, b"x"))
    at(monkeypatch, 1_000_000.0 + skew)  # the receiver's clock: message skew s old
    with pytest.raises(AuthError) as ei:
        b.open(CH_REQUEST, env)
    assert str(ei.value) == f"message timestamp is {skew:+.1f}s off (window 60s)"
    assert ei.value.hint == "check the clocks of both hosts (NTP)"


def test_timestamp_inside_the_window_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Authenticator(TOKEN), Authenticator(TOKEN)
    at(monkeypatch, 1_000_000.0)
    env = env_of(a.seal(CH_REQUEST, b"x"))
    at(monkeypatch, 1_000_059.0)
    assert b.open(CH_REQUEST, env) == b"x"


def test_nonce_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Authenticator(TOKEN), Authenticator(TOKEN, max_nonces=3)
    envs = [env_of(a.seal(CH_NOTIF, b"%d" % i)) for i in range(5)]
    for e in envs:
        b.open(CH_NOTIF, e)
    assert len(b._seen) == 3
    # Old nonces are forgotten once outside the window: a replay of them is then stale.
    at(monkeypatch, envs[-1].ts + 61)
    with pytest.raises(AuthError, match="timestamp"):
        b.open(CH_NOTIF, envs[0])


def test_open_is_thread_safe_against_replays() -> None:
    a, b = Authenticator(TOKEN), Authenticator(TOKEN)
    env = env_of(a.seal(CH_NOTIF, b"once"))
    ok: list[bytes] = []
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        with contextlib.suppress(AuthError):
            ok.append(b.open(CH_NOTIF, env))

    ts = [threading.Thread(target=worker) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert ok == [b"once"]


# ------------------------------------------------------------------ token files


def _token_file(tmp_path: Path, content: bytes, mode: int) -> str:
    p = tmp_path / "token"
    p.write_bytes(content)
    os.chmod(p, mode)
    return str(p)


def test_token_file_ok(tmp_path: Path) -> None:
    path = _token_file(tmp_path, TOKEN + b"\n", 0o600)
    assert load_token_file(path) == TOKEN  # trailing newline stripped


@pytest.mark.parametrize("mode", [0o604, 0o644, 0o666, 0o601])
def test_token_file_readable_by_others_refused(tmp_path: Path, mode: int) -> None:
    path = _token_file(tmp_path, TOKEN, mode)
    with pytest.raises(ConfigError) as ei:
        load_token_file(path)
    assert str(ei.value) == f"auth token file {path} is readable by other users"
    assert ei.value.hint == f"run: chmod 600 {path}"


def test_token_file_missing(tmp_path: Path) -> None:
    path = str(tmp_path / "nope")
    with pytest.raises(ConfigError) as ei:
        load_token_file(path)
    assert str(ei.value) == f"cannot read auth token file {path}: No such file or directory"
    assert ei.value.hint == "check the path and permissions"


def test_token_file_too_short(tmp_path: Path) -> None:
    path = _token_file(tmp_path, b"short\n", 0o600)
    with pytest.raises(ConfigError) as ei:
        load_token_file(path)
    assert str(ei.value) == f"auth token in {path} is shorter than 16 bytes"
    assert ei.value.hint == (
        "generate one: head -c 32 /dev/urandom | xxd -p > FILE && chmod 600 FILE"
    )


def test_token_file_is_a_directory(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    with pytest.raises(ConfigError, match=f"cannot read auth token file {d}: Is a directory"):
        load_token_file(str(d))
