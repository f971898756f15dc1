"""``drive --workload``'s options and how they become a ``Replay``.

Owns the option types of the trace replay (``--workload``, ``--speedup``, ``--limit``,
``--start-at``, ``--block-tokens``), ``refuse_mixed`` (the load-shape options of a plain drive
-- ``--requests``, ``--rate``, ``--blocks``, ``--tokens`` -- do not go with a trace, and the
replay's do not go without one) and ``replay`` (the trace read, each bad line said on stderr as
it is found, into a ``kvpush.commands.drive.workload.Replay``). Imports typer only; the trace
reader on use. Main thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from kvpush.commands.common.optspec import option
from kvpush.config import require_counts, require_positive
from kvpush.errors import ConfigError

if TYPE_CHECKING:
    from kvpush.commands.drive.workload import Replay

#: Requests in flight at once when a trace is replayed and --concurrency is not given: open
#: loop needs a worker free whenever a request is due.
WORKLOAD_CONCURRENCY = 128

Workload = Annotated[
    str | None,
    option(
        "--workload",
        help="Replay a request trace in the Mooncake format (JSON lines: timestamp ms, "
        "input_length, output_length, hash_ids; a file, or - for stdin), open loop: each "
        "request at its timestamp / --speedup, whether or not earlier ones finished, with "
        "ceil(input_length / --block-tokens) blocks. A bad line is named on stderr and skipped. "
        "Instead of --requests, --rate, --blocks, --tokens; -c defaults to 128.",
        metavar="FILE|-",
        show_default=False,
    ),
]

Speedup = Annotated[
    float,
    option("--speedup", help="With --workload: replay this many times faster than the trace."),
]

Limit = Annotated[
    int | None,
    option(
        "--limit",
        help="With --workload: replay at most this many requests.",
        show_default=False,
    ),
]

StartAt = Annotated[
    float,
    option(
        "--start-at",
        help="With --workload: start at the first request this far into the trace (its "
        "timestamps); the replay's clock starts at that request.",
        seconds=True,
    ),
]

BlockTokens = Annotated[
    int | None,
    option(
        "--block-tokens",
        help="With --workload: tokens per block, so a request is ceil(input_length / N) "
        "blocks (per rank). Default: the --shape's, else 16 (vLLM's default block; a pool of "
        "flat --block-bytes has no token size of its own).",
        scope="drive",
        show_default=False,
    ),
]

#: Plain drive's options that size and pace the load: a trace does both.
PLAIN_ONLY = {
    "requests": "--requests",
    "rate": "--rate",
    "blocks": "--blocks",
    "tokens": "--tokens",
}
#: The replay's options: they mean nothing without a trace.
REPLAY_ONLY = {
    "speedup": "--speedup",
    "limit": "--limit",
    "start_at": "--start-at",
    "block_tokens": "--block-tokens",
}


def refuse_mixed(ctx: typer.Context, given: Callable[[typer.Context, str], bool]) -> None:
    """Options of the other kind of run are refused, naming them."""
    if ctx.params.get("workload") is not None:
        extra = [flag for name, flag in PLAIN_ONLY.items() if given(ctx, name)]
        if extra:
            raise ConfigError(
                f"--workload sizes and paces the requests itself: not with {', '.join(extra)}",
                "drop them, or drop --workload (--limit, --speedup and --start-at shape a replay)",
            )
        return
    extra = [flag for name, flag in REPLAY_ONLY.items() if given(ctx, name)]
    if extra:
        raise ConfigError(
            f"{', '.join(extra)} shape a trace replay: they take --workload FILE",
            "add --workload FILE (a Mooncake-format trace; 'kvpush workload synth' makes one)",
        )


def replay(
    source: str,
    *,
    speedup: float,
    limit: int | None,
    start_at: float,
    block_tokens: int | None,
    shape: str | None,
    token: bytes | None,
    say: Callable[[str], None],
) -> Replay:
    """The trace read (each bad line said as it is found) and its replay."""
    from kvpush.commands.drive.workload import DEFAULT_BLOCK_TOKENS, Replay
    from kvpush.commands.workload.trace import load

    require_positive("--speedup", speedup, "1 replays the trace at its own pace")
    if limit is not None:
        require_counts(("--limit", limit))
    if not start_at >= 0:
        raise ConfigError(f"--start-at must be 0 or more, got {start_at:g}")
    if block_tokens is not None:
        require_counts(("--block-tokens", block_tokens))
    elif shape:
        from kvpush.memory.shapes import get_shape

        block_tokens = get_shape(shape).block_tokens
    wl = load(source, limit=limit, start_at_s=start_at, on_problem=lambda p: say(f"workload {p}"))
    return Replay(wl, block_tokens or DEFAULT_BLOCK_TOKENS, speedup, say, token)
