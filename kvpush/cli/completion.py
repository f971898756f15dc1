"""``kvpush completion SHELL``: print the shell completion script (the one under completions/).

Owns ``completion_script`` (typer's script with a header; ``kvpush.cli.gendocs`` writes the same
into completions/); it asks ``kvpush`` itself on every Tab, which is why importing the CLI stays
light. Main thread.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvpush import __version__
from kvpush.commands.common import options, stdio
from kvpush.commands.common.options import Shell

PROG = "kvpush"
COMPLETE_VAR = "_KVPUSH_COMPLETE"

_INSTALL = {
    "bash": "kvpush completion bash > ~/.local/share/bash-completion/completions/kvpush",
    "zsh": 'kvpush completion zsh > "${fpath[1]}/_kvpush"   (then: compinit)',
    "fish": "kvpush completion fish > ~/.config/fish/completions/kvpush.fish",
}


def completion_script(shell: str) -> str:
    """The completion script for ``shell``: typer's, which asks ``kvpush`` itself on each Tab."""
    # typer's own --show-completion uses this function (typer.completion re-exports it).
    from typer._completion_shared import get_completion_script

    body = get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell)
    header = (
        f"# {shell} completion for kvpush {__version__}. Generated from the CLI by\n"
        "# 'python -m kvpush.cli.gendocs' (also: 'kvpush completion " + shell + "'); "
        "do not edit.\n"
        f"# Install: {_INSTALL[shell]}\n"
    )
    if body.startswith("#compdef"):
        first, _, rest = body.partition("\n")
        return f"{first}\n{header}{rest.rstrip()}\n"
    return f"{header}{body.rstrip()}\n"


DOC = """Print a shell completion script.

bash: kvpush completion bash > ~/.local/share/bash-completion/completions/kvpush;
zsh: kvpush completion zsh > "${fpath[1]}/_kvpush";
fish: kvpush completion fish > ~/.config/fish/completions/kvpush.fish."""


def register(app: typer.Typer) -> None:
    options.register(app, "completion", completion, DOC)


def completion(
    shell: Annotated[Shell, typer.Argument(help="The shell to print a completion script for.")],
) -> None:
    stdio.out(completion_script(shell.value), end="")
