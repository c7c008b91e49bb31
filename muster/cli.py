"""`muster`: every Muster command in one CLI.

- the user commands and the broker's (`submit`, `status`, ..., `broker`, `config`): broker/cli.py;
- the agent's (`agent`, `fleet`): agents/cli.py;
- the load programs (`bench <name>`, `sim`, `vopr`, `chaos`, `demo`): load/cli.py, imported
  only when one of them runs, so a `muster status` or a broker's start never pays for them.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from agents import cli as agents_cli
from broker import cli as broker_cli

LOAD_COMMANDS = ("bench", "sim", "autoscale", "vopr", "chaos", "demo", "demo-local")


class _Group(typer.core.TyperGroup):
    """The `muster` group: the load commands come from load/cli.py on first use."""

    # The context and command types are click's, which typer re-exports under different
    # names across its supported releases: left untyped here.
    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *LOAD_COMMANDS]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in LOAD_COMMANDS:
            return super().get_command(ctx, cmd_name)
        from load import cli as load_cli

        if cmd_name == "bench":
            return typer.main.get_command(load_cli.bench)
        group = typer.main.get_command(load_cli.programs)
        assert isinstance(group, typer.core.TyperGroup)
        return group.get_command(ctx, cmd_name)


app = typer.Typer(
    name="muster",
    cls=_Group,
    help="Muster: gang admission of GPU training jobs across clusters, over NATS.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_show_locals=False,  # never print a password held in a local
    rich_markup_mode=None,
)
app.registered_commands += broker_cli.app.registered_commands
app.registered_commands += agents_cli.app.registered_commands


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"muster {version('muster')}")
        except PackageNotFoundError:
            typer.echo("muster (not installed as a package)")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Muster: gang admission of GPU training jobs across clusters, over NATS."""


def main(*args: Any) -> None:
    """Console-script entry point."""
    app(*args)
