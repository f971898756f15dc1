"""How ``drive`` shows a run going: the progress bar on a terminal, and what each result feeds.

Owns ``each_result`` (each result to the replay's record, ``--workload``, and to the progress
bar) and ``with_bar`` (the driver's run under a transient rich progress bar on stderr).
``on_result`` runs on the thread that decided the request; ``with_bar`` on the main thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from kvpush.commands.common.results import DriveReport, RequestResult
    from kvpush.commands.drive.driver import Driver
    from kvpush.commands.drive.workload import Replay


def each_result(
    replay: Replay | None, advance: list[Callable[[RequestResult], object]]
) -> Callable[[RequestResult], None]:
    """What each result is handed to: the replay's record (``--workload``), the progress bar."""

    def on_result(r: RequestResult) -> None:
        if replay is not None:
            replay.on_result(r)
        advance[0](r)

    return on_result


def with_bar(
    driver: Driver, advance: list[Callable[[RequestResult], object]], err: Console, requests: int
) -> DriveReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("requests", total=requests)
        advance[0] = lambda r: bar.advance(task)
        return driver.run()
