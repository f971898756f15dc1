"""``read_secret_file``: the one reader of a secret kept in a file (the auth token, the etcd
password), which refuses a file other users can reach and words its errors the caller's way;
and the password file's own messages, which go through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpush.errors import ConfigError
from kvpush.fleet.config import read_password_file
from kvpush.wire.auth import SecretFileWords, read_secret_file

WORDS = SecretFileWords(
    missing=("no {path}: {strerror}", "look at {path}"),
    loose=("{path} is open (mode {mode:03o})", "chmod 600 {path}"),
    unreadable=("{path} unread: {strerror} ({error})", ""),
)
REGULAR_ONLY = SecretFileWords(
    missing=WORDS.missing,
    loose=WORDS.loose,
    unreadable=WORDS.unreadable,
    not_regular=("{path} is no file", "give a file"),
)


def _secret(tmp_path: Path, content: bytes, mode: int = 0o600) -> str:
    p = tmp_path / "secret"
    p.write_bytes(content)
    os.chmod(p, mode)
    return str(p)


def _refusal(path: str, words: SecretFileWords = WORDS) -> tuple[str, str | None]:
    with pytest.raises(ConfigError) as ei:
        read_secret_file(path, words)
    return ei.value.message, ei.value.hint


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o660])
def test_a_private_file_is_read_as_it_is(tmp_path: Path, mode: int) -> None:
    content = b"  s3cret\r\n\xff second line \n"
    assert read_secret_file(_secret(tmp_path, content, mode), WORDS) == content


@pytest.mark.parametrize("mode", [0o604, 0o602, 0o601, 0o644, 0o666, 0o607])
def test_a_file_other_users_reach_is_refused_naming_its_mode(tmp_path: Path, mode: int) -> None:
    path = _secret(tmp_path, b"s3cret", mode)
    assert _refusal(path) == (f"{path} is open (mode {mode:03o})", f"chmod 600 {path}")


def test_a_missing_file_is_said_in_the_system_s_words(tmp_path: Path) -> None:
    path = str(tmp_path / "none")
    assert _refusal(path) == (f"no {path}: No such file or directory", f"look at {path}")


def test_a_directory_is_refused_before_reading_where_the_caller_asks(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir()
    os.chmod(d, 0o700)
    assert _refusal(str(d), REGULAR_ONLY) == (f"{d} is no file", "give a file")
    # without ``not_regular``, the read itself fails
    assert _refusal(str(d)) == (f"{d} unread: Is a directory (IsADirectoryError)", "")


def test_the_mode_is_checked_before_the_kind_of_file_only_for_a_caller_without_it(
    tmp_path: Path,
) -> None:
    d = tmp_path / "open-dir"
    d.mkdir()
    os.chmod(d, 0o755)
    assert _refusal(str(d), REGULAR_ONLY)[0] == f"{d} is no file"
    assert _refusal(str(d))[0] == f"{d} is open (mode 755)"


def test_no_error_shows_the_secret(tmp_path: Path) -> None:
    path = _secret(tmp_path, b"s3cret-value", 0o644)
    message, hint = _refusal(path)
    assert "s3cret" not in message and "s3cret" not in (hint or "")


# ------------------------------------------------------------------ the password file's words

FLAG = "--registry-password-file"


def _password_refusal(path: str) -> tuple[str, str | None]:
    with pytest.raises(ConfigError) as ei:
        read_password_file(path)
    return ei.value.message, ei.value.hint


@pytest.mark.parametrize(
    "content", [b"s3cret", b"s3cret\n", b"s3cret\r\n", b"s3cret\r", b"s3cret\n\n"]
)
def test_the_password_is_its_one_line(tmp_path: Path, content: bytes) -> None:
    assert read_password_file(_secret(tmp_path, content)) == "s3cret"


@pytest.mark.parametrize("content", [b"", b"\n", b"two\nlines", b"two\rlines\n", b"a\r\nb"])
def test_a_password_file_not_of_one_line_is_refused(tmp_path: Path, content: bytes) -> None:
    path = _secret(tmp_path, content)
    assert _password_refusal(path) == (
        f"{FLAG} {path} must hold the password on exactly one line",
        "write it with: printf '%s' \"$PASSWORD\" > FILE; chmod 600 FILE",
    )


def test_the_password_file_s_refusals_in_its_words(tmp_path: Path) -> None:
    loose = _secret(tmp_path, b"s3cret\n", 0o644)
    assert _password_refusal(loose) == (
        f"{FLAG} {loose} is readable by other users (mode 644)",
        f"restrict it to its owner: chmod 600 {loose}",
    )
    missing = str(tmp_path / "none")
    assert _password_refusal(missing) == (
        f"{FLAG} {missing}: No such file or directory",
        "check the path and its permissions",
    )
    assert _password_refusal(str(tmp_path)) == (
        f"{FLAG} {tmp_path} is not a regular file",
        "give the path of a file",
    )
    latin = tmp_path / "latin1"
    latin.write_bytes("pässwört\n".encode("latin-1"))
    latin.chmod(0o600)
    assert _password_refusal(str(latin)) == (
        f"{FLAG} {latin} cannot be read as UTF-8 text: UnicodeDecodeError",
        "put the password on one line of a UTF-8 file",
    )


def test_a_utf8_password_is_read_whole(tmp_path: Path) -> None:
    assert read_password_file(_secret(tmp_path, "pässwört €\n".encode())) == "pässwört €"
