"""`muster bench <name>`, `muster sim`, `muster vopr`, `muster chaos`, `muster demo`: the load,
simulation and demo programs of load/ as `muster` commands.

Each program declares its options once, as the typer command `app` of its module, which its
`python -m load.<module>` form (the docs and the Makefile use it) also runs: `muster bench e2e
--runs 3` and `python -m load.bench_e2e --runs 3` parse and run the same command. Its module is
imported only when the command runs or its own help is asked for: a `muster status`, and the
listing of `muster --help`, never import load/.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer

# Unknown options and --help go to the program's own command.
_PASS_THROUGH: dict[str, Any] = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "help_option_names": [],
}


class _Program(typer.core.TyperCommand):
    """A program listed by name and help line; its module is imported when the command runs."""

    module = ""

    # The click types are left as Any: typer re-exports them under different names across its
    # supported releases.
    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        own: typer.Typer = importlib.import_module(self.module).app
        return typer.main.get_command(own).make_context(info_name, args, parent=parent, **extra)


def _command(app: typer.Typer, name: str, module: str, help_text: str) -> None:
    """`help_text` is the command's summary in its group's listing (the program's own --help
    says the rest), so it is given whole as the short help: under 60 characters, it fits an
    80-column `muster --help` uncut."""
    # A sibling module of this package, by name: imported only when its command runs.
    program = type(f"_Program_{module}", (_Program,), {"module": f"load.{module}"})

    def command() -> None:
        pass  # never called: `_Program.make_context` hands the run to the program's own command

    command.__doc__ = help_text
    app.command(
        name,
        cls=program,
        short_help=help_text,
        context_settings=_PASS_THROUGH,
        add_help_option=False,
    )(command)


bench = typer.Typer(
    name="bench",
    help="Benchmarks (docs/benchmarks.md); each prints a RESULT line of JSON.",
    short_help="Benchmarks; each prints a RESULT line of JSON.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)
for _name, _module, _help in (
    ("core", "bench_core", "Placement decisions/s, 100,000 pending jobs (pure core)."),
    ("cycle", "bench_cycle", "Admission cycle after a capacity change, by queue depth."),
    ("e2e", "bench_e2e", "Submit -> dispatch acked over NATS: admissions/s, latency."),
    ("flood", "bench_flood", "Another queue's submission latency while one queue floods."),
    ("ingest", "bench_ingest", "Agent events/s applied by the broker."),
    ("kube-agent", "bench_kube_agent", "The kube agent at 5,000 nodes x 150,000 pods."),
    ("memory", "bench_memory", "Broker bytes per pending job and its top allocators."),
    ("nats-failover", "bench_nats_failover", "Serving again after kill -9 of each NATS leader."),
    ("scale", "bench_scale", "Broker RSS with 100,000 pending; kill -9 and recovery time."),
    ("spot", "bench_spot", "Spot notice -> new attempt acked elsewhere, p50/p99."),
    ("ui", "bench_ui", "Dashboard page loads with 100,000 jobs in the broker."),
    ("reclaim-storm", "reclaim_storm", "Reclaim with team queues: how often one job is evicted."),
):
    _command(bench, _name, _module, _help)

# The programs that are not benchmarks, as top-level `muster` commands.
programs = typer.Typer(add_completion=False, rich_markup_mode=None)
for _name, _module, _help in (
    ("sim", "sim", "Trace-driven simulation against other recovery policies."),
    ("autoscale", "autoscale", "Autoscaled pools: warm, from zero, with stockouts."),
    ("vopr", "vopr", "Deterministic simulation of the protocol with faults."),
    ("chaos", "chaos", "Chaos soak of real processes: kill -9, stops, partitions."),
    ("demo", "demo", "Muster end to end in one process with three fake clusters."),
    ("demo-local", "demo_local", "The spot story with real local processes and training."),
):
    _command(programs, _name, _module, _help)
