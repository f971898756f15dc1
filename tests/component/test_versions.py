"""NIXL/UCX versions (issue 16, item 4): the known-bad table, reading UCX's version, probe
showing both sides' versions."""

from __future__ import annotations

import json
import re

import pytest

from kvpush.transport.versions import (
    KNOWN_ISSUES,
    Versions,
    issues_for,
    local_versions,
    parse_version,
    ucx_version,
    warnings_for,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [("1.20.0", (1, 20, 0)), ("v1.5.1", (1, 5, 1)), ("1.5.1rc2", (1, 5, 1)), ("", None),
     ("unknown", None), ("0.10", (0, 10))],
)  # fmt: skip
def test_parse_version(text: str, want: tuple[int, ...] | None) -> None:
    assert parse_version(text) == want


@pytest.mark.parametrize(
    ("nixl", "ucx", "refs"),
    [
        ("1.3.1", "1.22.0", ["NIXL #1986, fixed by NIXL PR #1987"]),  # vLLM #49238's NIXL
        ("1.4.1", "", ["NIXL #1986, fixed by NIXL PR #1987"]),
        ("0.10.1", "1.20.0", ["NIXL #1986, fixed by NIXL PR #1987", "NIXL #1668"]),
        ("1.5.0", "1.20.1", ["NIXL #1668"]),
        ("1.5.0", "1.22.0", []),
        ("1.5.1", "1.23.0", []),
        ("", "", []),  # unknown versions: no warning (nothing to say)
        ("unknown", "1.21.0", []),
    ],
)
def test_known_issues_by_version(nixl: str, ucx: str, refs: list[str]) -> None:
    v = Versions(nixl=nixl, ucx=ucx)
    assert [k.ref for k in issues_for(v)] == refs
    lines = warnings_for(v)
    assert len(lines) == len(refs)
    for line, ref in zip(lines, refs, strict=True):
        assert ref in line and ("use " in line)


def test_warning_text_names_version_reference_and_advice() -> None:
    assert warnings_for(Versions(nixl="1.4.0")) == [
        "NIXL 1.4.0: a D may segfault in loadRemoteMD (ucp_ep_rkey_unpack) when its P "
        "restarted: UCX's endpoint teardown races the remote key unpack (NIXL #1986, fixed "
        "by NIXL PR #1987); use NIXL >= 1.5.0"
    ]


def test_table_ranges_are_well_formed() -> None:
    for k in KNOWN_ISSUES:
        assert k.component in ("nixl", "ucx")
        assert k.fixed is None or k.first < k.fixed
        assert k.ref and k.what and k.advice


def test_ucx_version_read_from_the_library() -> None:
    v = ucx_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", v), v
    mine = local_versions()
    assert mine.ucx == v
    assert mine.nixl and mine.nixl_build.startswith("nixl")


@pytest.mark.integration
def test_probe_shows_both_sides_versions(pd_pair, kvpush_run) -> None:
    p, _ = pd_pair
    r = kvpush_run("probe", p.address, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    mine = local_versions()
    assert out["metadata"]["nixl_version"] == mine.nixl
    assert out["metadata"]["ucx_version"] == mine.ucx
    assert out["local_versions"] == {
        "nixl": mine.nixl,
        "nixl_build": mine.nixl_build,
        "ucx": mine.ucx,
    }
    same = warnings_for(mine)  # the same install both sides
    assert out["version_warnings"] == [f"peer: {w}" for w in same] + [
        f"this host: {w}" for w in same
    ]
    text = kvpush_run("probe", p.address)
    assert f"nixl {mine.nixl} · ucx {mine.ucx}" in text.stdout
    assert f"this host     nixl {mine.nixl} ({mine.nixl_build}) · ucx {mine.ucx}" in text.stdout
