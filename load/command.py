"""A load program's one typer command: `muster <...>` runs it, and so does its
`python -m load.<module>` alias, from the same option declarations."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer

# A program's parsed options, as its runner reads them (`options.jobs`).
Options = SimpleNamespace


def program() -> typer.Typer:
    """The Typer app of one load program: one command, whose help is the module's summary."""
    return typer.Typer(
        add_completion=False,
        rich_markup_mode=None,
        pretty_exceptions_show_locals=False,
    )


def summary(doc: str | None) -> str | None:
    """A module docstring's first paragraph: the command's help."""
    return doc.split("\n\n")[0] if doc else None


def run(app: typer.Typer, argv: Sequence[str], prog_name: str) -> int:
    """Run the program as from its command line, within this process: its exit status."""
    try:
        app(args=list(argv), prog_name=prog_name)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


# A count of at least one (jobs, runs, queues, clusters); and nodes per cluster.
Count = Annotated[int, typer.Option(min=1)]
Nodes = Annotated[int, typer.Option(min=1, help="per cluster")]

# `--json PATH`, as every benchmark spells it.
JsonOut = Annotated[str | None, typer.Option("--json", help="also write the result here")]

# `--baseline DIR`: another checkout the benchmark runs alike, interleaved run by run.
Baseline = Annotated[
    Path | None,
    typer.Option("--baseline", help="another checkout to measure alike, interleaved"),
]


def trees(this: Path, baseline: Path | None) -> dict[str, Path]:
    """The checkouts a benchmark with `--baseline` runs in, by label, this one first."""
    return {"this": this} | ({"baseline": baseline.resolve()} if baseline else {})
