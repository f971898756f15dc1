"""The options of ``kvpush fleet ls|watch|check`` and of ``drive --registry``.

Owns the declarations only the fleet commands use (``FLEET_OPTS``, indexed with every other
option in ``kvpush.cli.options.OPTIONS``) and the entry lists of the three subcommands. The
registry options themselves (``--registry``, ``--cluster`` and the etcd credentials) are the
ones ``serve-*`` declares, so an endpoint and the tools that read its registration take the same
flags and ``KVPUSH_*`` variables.

Imports typer only (no torch, nixl, zmq or etcd client). Runs on the main thread at import time.
"""

from __future__ import annotations

from kvpush.cli.optspec import PANEL_OUT, Entry, Opt

FLEET_OPTS: list[Opt] = [
    Opt("json_out", ("--json",), bool, "One JSON object on stdout.", False, PANEL_OUT,
        key="fleet.ls.json", env_scope="fleet_ls"),
    Opt("json_out", ("--json",), bool,
        "One JSON object per line on stdout: the listing at start ('snapshot'), then each join, "
        "leave and restart, and a 'rows' line every --interval.", False, PANEL_OUT,
        key="fleet.watch.json", env_scope="fleet_watch"),
    Opt("duration", ("--duration",), float | None,
        "Stop after this many seconds (default: until Ctrl-C).", None, seconds=True,
        show_default=False),
    Opt("interval", ("--interval",), float,
        "Seconds between redraws of the live view (and between 'rows' lines).", 1.0,
        seconds=True, key="fleet.interval", env_scope="fleet"),
    Opt("json_out", ("--json",), bool, "The whole matrix as one JSON object on stdout.", False,
        PANEL_OUT, key="fleet.check.json", env_scope="fleet_check"),
    Opt("size", ("--size",), str,
        "Bytes per check push (e.g. 1MiB, 256KiB, 4096): blocks = size / one block of P "
        "(capped at the smaller pool).", "1MiB"),
    Opt("pushes", ("--pushes",), int,
        "Verified pushes per pair (the first carries the handshake of a pair that never met).",
        3),
    Opt("concurrency", ("--concurrency", "-c"), int, "Pairs checked at once.", 8,
        key="fleet.concurrency", env_scope="fleet"),
    Opt("deadline", ("--deadline",), float,
        "Seconds one pair's check may take (every push included); a pair past it fails with "
        "'deadline'.", 10.0, seconds=True),
    Opt("strict", ("--strict",), bool,
        "Also fail (exit 3) on incompatible or skipped pairs, not only on pairs whose pushes "
        "fail.", False),
]  # fmt: skip

#: The registry options every fleet-aware command takes (declared with serve-*'s).
REGISTRY: list[Entry] = [
    "registry", "cluster", "registry_user", "registry_password_file", "registry_ca",
    "registry_cert", "registry_key",
]  # fmt: skip
FLEET_LS: list[Entry] = [*REGISTRY, "fleet.ls.json"]
FLEET_WATCH: list[Entry] = [*REGISTRY, "fleet.watch.json", "duration", "fleet.interval"]
FLEET_CHECK: list[Entry] = [
    *REGISTRY, "size", "pushes", "fleet.concurrency", "deadline", "strict", "fleet.check.json",
    "auth_token_file",
]  # fmt: skip
