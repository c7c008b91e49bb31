"""`muster`: every Muster command in one CLI.

The commands are defined where they belong (broker/cli.py, broker/cli_operator.py,
broker/cli_live.py, broker/cli_nodeops.py, agents/cli.py, and each load program's module) and
listed here with their summaries; a command's module is imported only when it runs or its own
help is asked for, so `muster --help` and `muster status` pay only for what they show or run.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from shell.cli import LazyGroup
from shell.lazyimport import defer_unused

BROKER, OPERATOR = "broker.cli.app", "broker.cli_operator.app"
LIVE, NODEOPS, AGENTS = "broker.cli_live.app", "broker.cli_nodeops.app", "agents.cli.app"

# Each command: where it is defined, and its summary in `muster --help` (under 60 characters:
# it fits an 80-column listing uncut).
COMMANDS: dict[str, tuple[str, str]] = {
    "submit": (BROKER, "Submit a JobSpec or a Kubernetes job manifest."),
    "status": (BROKER, "List jobs, or show one job."),
    "cancel": (BROKER, "Cancel a job (its running attempt is stopped)."),
    "why": (BROKER, "Why a job waits, or where and why it runs."),
    "queues": (BROKER, "Queues: jobs, usage against quota."),
    "clusters": (BROKER, "Clusters: health, flavors, free GPUs, prices."),
    "watch": (BROKER, "Follow a job's events until it ends."),
    "broker": (OPERATOR, "Run the broker."),
    "store-compact": (OPERATOR, "Free a full job bucket: drop ended jobs' workloads."),
    "config": (OPERATOR, "Check a broker config; print it resolved."),
    "nats-config": (OPERATOR, "Print NATS users and permissions."),
    "jobs-backup": (OPERATOR, "Back up every job record to FILE; the broker may run."),
    "jobs-restore": (OPERATOR, "Restore the job bucket from FILE, with no broker leading."),
    "schema": (OPERATOR, "Print the JSON Schema of the client-facing messages."),
    "top": (LIVE, "Live view: clusters, queues, busiest jobs, interruptions."),
    "logs": (LIVE, "Print a job's container logs, read through its agent."),
    "cordon": (NODEOPS, "Stop placing new gangs on a node (or every node)."),
    "uncordon": (NODEOPS, "Let a cordoned node take new gangs again."),
    "drain": (NODEOPS, "Cordon a node and move what runs there."),
    "notice": (NODEOPS, "Send a spot notice for a node of a fake or local cluster."),
    "agent": (AGENTS, "Run one cluster agent, or each agent of a fleet file."),
    "fence-watchdog": (AGENTS, "Delete workloads whose fence lapsed (a hung agent's)."),
    "fleet": (AGENTS, "Run many (fake) cluster agents in one process."),
    "bench": ("load.cli.bench", "Benchmarks; each prints a RESULT line of JSON."),
    # The load programs (load/cli.py has the benchmarks): each declares its options once, as
    # the typer command `app` of its module, which its `python -m load.<module>` form runs too.
    "sim": ("load.sim.app", "Trace-driven simulation against other recovery policies."),
    "autoscale": ("load.autoscale.app", "Autoscaled pools: warm, from zero, with stockouts."),
    "vopr": ("load.vopr.app", "Deterministic simulation of the protocol with faults."),
    "chaos": ("load.chaos.app", "Chaos soak of real processes: kill -9, stops, partitions."),
    "demo": ("load.demo.app", "Muster end to end in one process with three fake clusters."),
    "demo-local": ("load.demo_local.app", "The spot story with real local processes and training."),
}
LOAD_COMMANDS = ("bench", "sim", "autoscale", "vopr", "chaos", "demo", "demo-local")


class Muster(LazyGroup):
    lazy_subcommands = COMMANDS


app = typer.Typer(
    name="muster",
    cls=Muster,
    help="Muster: gang admission of GPU training jobs across clusters, over NATS.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_show_locals=False,  # never print a password held in a local
    rich_markup_mode=None,
)


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
    defer_unused()  # before any command imports nats-py
    app(*args)
