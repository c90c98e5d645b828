"""The Typer application and its top-level options; commands register on ``app``."""

from __future__ import annotations

import typer

from consequence.cli.common import console

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="consequence: reinforcement learning of language-model agents."
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"consequence {version('consequence')}")
        raise typer.Exit()


@app.callback()
def main(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """consequence: reinforcement learning of language-model agents."""
