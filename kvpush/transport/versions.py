"""NIXL and UCX versions in use, and the releases known to be affected by bugs kvpush meets.

Owns ``local_versions()`` (this process's NIXL release, the NIXL build package, the UCX
library's version), ``KNOWN_ISSUES`` (the one table of affected releases) and the pure
``issues_for`` / ``warnings_for`` that an endpoint logs at start and ``probe`` shows. The UCX
version is read from the UCX library itself (``ucp_get_version_string``, through ctypes): the
copy NIXL's UCX backend loaded into this process when there is one (``/proc/self/maps``), else
the one bundled in the NIXL wheel (``nixl_cuXX.libs``), else ``ucx_info -v``; ``""`` when none
can be read. Called from any thread; the library is read once and the answer cached.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from kvpush.transport.nixl import nixl_version


@dataclass(frozen=True)
class Versions:
    nixl: str = ""  # the nixl distribution's version ("" or "unknown" when not read)
    nixl_build: str = ""  # the package that holds NIXL's native code, e.g. nixl_cu13
    ucx: str = ""  # the UCX library's version, "" when not readable


@dataclass(frozen=True)
class KnownIssue:
    """A bug of a NIXL or UCX release range (``first`` included, ``fixed`` excluded)."""

    component: str  # "nixl" | "ucx"
    first: tuple[int, ...]
    fixed: tuple[int, ...] | None  # None: no fixed release known
    what: str
    ref: str
    advice: str


#: Releases known to be affected (issue 16). Sources, read 2026-12 in NIXL's repository:
#: - loadRemoteMD race: NIXL issue #1986 (vLLM #49238), fixed by NIXL PR #1987, merged to NIXL's
#:   main on 2026-07-29 (commit 3e3e083c9) after main's version bump to 1.4.0; the branches
#:   release/1.4.0 and release/1.4.1 do not contain it. No 1.5 release branch or tag was in the
#:   snapshot read, so "fixed in 1.5.0" is inferred from the branch history (1.5.x is cut from a
#:   later main), not confirmed by release notes. Reported with NIXL 1.3.1; every release before
#:   the fix has the unguarded unpack, hence ``first`` = 0.
#: - Concurrent agent start: NIXL issue #1668 (open): nixl-cu13 0.10.1 bundles UCX 1.20.0, whose
#:   uct_md_query_tl_resources loops for ever when two agents initialise at once; not
#:   reproduced with the UCX 1.22 that NIXL bundles since PR #1868. Only UCX 1.20.x is listed.
KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        "nixl",
        (0,),
        (1, 5, 0),
        "a D may segfault in loadRemoteMD (ucp_ep_rkey_unpack) when its P restarted: UCX's "
        "endpoint teardown races the remote key unpack",
        "NIXL #1986, fixed by NIXL PR #1987",
        "use NIXL >= 1.5.0",
    ),
    KnownIssue(
        "ucx",
        (1, 20, 0),
        (1, 21, 0),
        "two NIXL agents initialising at once in one process may hang in "
        "uct_md_query_tl_resources (the TP ranks of one endpoint do that)",
        "NIXL #1668",
        "use a NIXL build bundling UCX >= 1.22 (or run with --tp 1)",
    ),
)


def parse_version(text: str) -> tuple[int, ...] | None:
    """``"1.20.0"`` -> ``(1, 20, 0)``; ``"1.5.1rc2"`` -> ``(1, 5, 1)``; None if no number."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def issues_for(v: Versions) -> list[KnownIssue]:
    """The known issues the given versions are affected by (unknown versions: none)."""
    out = []
    for k in KNOWN_ISSUES:
        ver = parse_version(v.nixl if k.component == "nixl" else v.ucx)
        if ver is None:
            continue
        if ver >= k.first and (k.fixed is None or ver < k.fixed):
            out.append(k)
    return out


def warnings_for(v: Versions) -> list[str]:
    """One line per known issue: what, which version, the reference, what to do."""
    out = []
    for k in issues_for(v):
        ver = v.nixl if k.component == "nixl" else v.ucx
        name = "NIXL" if k.component == "nixl" else "UCX"
        out.append(f"{name} {ver}: {k.what} ({k.ref}); {k.advice}")
    return out


def _ucp_version(path: str) -> str:
    try:
        lib = ctypes.CDLL(path)
        fn = lib.ucp_get_version_string
        fn.restype = ctypes.c_char_p
        raw = fn()
        return raw.decode() if isinstance(raw, bytes) else ""
    except (OSError, AttributeError):
        return ""


def _loaded_libucp() -> str:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "/libucp" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return ""


def _nixl_build() -> str:
    """The NIXL package with the native code: ``nixl_cu13``/``nixl_cu12``, or ``nixl``."""
    for name in ("nixl_cu13", "nixl_cu12"):
        if name in sys.modules:
            return name
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        if importlib.util.find_spec(name) is not None:
            return name
    return ""


def _bundled_libucp(build: str) -> str:
    spec = importlib.util.find_spec(build) if build else None
    if spec is None or not spec.origin:
        return ""
    site = os.path.dirname(os.path.dirname(spec.origin))
    hits = sorted(glob.glob(os.path.join(site, f"{build}.libs", "libucp*.so*")))
    return hits[0] if hits else ""


def ucx_info_version(exe: str | None = None) -> str:
    """The UCX version ``ucx_info -v`` prints ("1.13.1"; ``exe``: that ucx_info, else the one
    on PATH), or "" when there is none or it says nothing readable."""
    exe = exe or shutil.which("ucx_info")
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"[Vv]ersion\s+(\d+\.\d+(?:\.\d+)?)", out)
    return m.group(1) if m else ""


def ucx_version(build: str = "") -> str:
    """The UCX library's version (see the module docstring), ``""`` when none is readable."""
    for path in (_loaded_libucp(), _bundled_libucp(build or _nixl_build())):
        if path:
            v = _ucp_version(path)
            if v:
                return v
    return ucx_info_version()


@functools.lru_cache(maxsize=1)
def _cached(loaded: str) -> Versions:
    build = _nixl_build()
    nv = nixl_version()
    return Versions(nixl="" if nv == "unknown" else nv, nixl_build=build, ucx=ucx_version(build))


def local_versions() -> Versions:
    """This process's NIXL and UCX versions (read again once UCX has been loaded)."""
    return _cached(_loaded_libucp())
