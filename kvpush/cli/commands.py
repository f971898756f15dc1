"""The command list of ``kvpush``: ``register_all`` adds each command to the app in order.

Each command lives in its own folder under ``kvpush.commands`` (its ``command.py``: help text,
options, and a body that imports its logic on use, so that importing the CLI stays light); the
``completion`` command is the shell's own (``kvpush.cli.completion``). Main thread.
"""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    from kvpush.cli import completion
    from kvpush.commands.bench import command as bench
    from kvpush.commands.demo import command as demo
    from kvpush.commands.drive import command as drive
    from kvpush.commands.fleet import command as fleet
    from kvpush.commands.leg import command as leg
    from kvpush.commands.probe import command as probe
    from kvpush.commands.serve import command as serve
    from kvpush.commands.workload import command as workload

    serve.register(app)
    probe.register(app)
    drive.register(app)
    leg.register(app)
    demo.register(app)
    fleet.register(app)
    bench.register(app)
    workload.register(app)
    completion.register(app)
