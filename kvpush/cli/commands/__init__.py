"""The commands of ``kvpush``, one module each; ``register_all`` adds them to the app in order.

Each module owns one command (or the two serve commands): its help text, a body that turns the
parsed options into one call into ``kvpush.ops`` (imported inside the body, so that importing
the CLI stays light) and the printing of the result through ``kvpush.cli.views``. They run on
the main thread.
"""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    from kvpush.cli.commands import bench, completion, demo, drive, fleet, leg, probe, serve

    serve.register(app)
    probe.register(app)
    drive.register(app)
    leg.register(app)
    demo.register(app)
    fleet.register(app)
    bench.register(app)
    completion.register(app)
