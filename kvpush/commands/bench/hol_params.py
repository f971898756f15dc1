"""The parameters and cases of scenario ``hol`` (``kvpush.commands.bench.hol``), apart so that
its report (``kvpush.commands.bench.hol_report``) reads them without importing the scenario.

Pure data; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.commands.bench.passes import SteadyLoad


@dataclass(frozen=True, kw_only=True)
class HolParams(SteadyLoad):
    before_s: float
    delay_s: float  # H: how late a slow peer answers handshakes
    timeout_s: float  # P's side-channel/handshake timeout: the dead peer's stall
    after_s: float
    repeats: int  # every (case, writer) window is run this many times with fresh new peers


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    joiners: tuple[tuple[str, float, float], ...]  # (worker name, reply delay, join offset)
    window_of: str  # "delay" or "timeout"
    #: A reference, not a test of the writer: its joiner is what another case's healthy peer is
    #: compared with, and it has no head-of-line targets of its own.
    reference: bool = False
