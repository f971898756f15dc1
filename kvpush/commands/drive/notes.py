"""Notes a drive run adds to its report: what an operator should know about the run itself.

Pure functions of the run's configuration and of what preflight found; the driver keeps the
notes in ``DriveReport.notes`` and the command prints them (``drive: note: ...``).
"""

from __future__ import annotations

from kvpush.commands.common.results import DriveConfig

#: A run planned (``--requests`` / ``--rate``) longer than this many ``--timeout`` s gets a note.
LONG_RUN_FACTOR = 100.0


def fmt_duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.2 h``, ``11.6 days``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def long_run_note(cfg: DriveConfig) -> str | None:
    """A note when ``--rate`` spreads the requests over far longer than a request may take:
    often a rate given in the wrong unit (it is requests per second)."""
    if not cfg.rate or cfg.requests < 2:
        return None
    planned = (cfg.requests - 1) / cfg.rate  # request i starts i / rate after the first
    if planned <= LONG_RUN_FACTOR * cfg.timeout_s:
        return None
    return (
        f"--rate {cfg.rate:g} requests/s starts the last of {cfg.requests} requests "
        f"{fmt_duration(planned)} after the first, more than {LONG_RUN_FACTOR:g} x "
        f"--timeout {cfg.timeout_s:g}s: check --rate (requests per second) if that is not meant"
    )


def down_at_start_note(address: str, why: str) -> str:
    return (
        f"{address} was down at start ({why}): the run went on with the other endpoints; it "
        "was re-checked every second and took requests once it answered and its role and "
        "geometry were checked"
    )
