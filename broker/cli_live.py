"""The operator's live commands (`muster top`, `muster logs`) and the dashboard options of
`muster broker`, kept apart from the request/reply commands in broker.cli."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Annotated, Any

import typer
from rich.console import Console

from broker.client import MusterClient, MusterError
from shell.cli import CONNECTION, CommonOptions, common, err, fail

UiPort = Annotated[
    int | None,
    typer.Option(
        "--ui-port",
        min=0,
        max=65535,
        help="serve the read-only web dashboard on --ui-host:PORT (off by default)",
        show_default=False,
    ),
]
UiHost = Annotated[
    str,
    typer.Option(
        "--ui-host",
        help="address the dashboard binds; anything but 127.0.0.1 belongs behind your auth proxy",
    ),
]


app = typer.Typer(rich_markup_mode=None, pretty_exceptions_show_locals=False)


def run_until_interrupted(main: Coroutine[Any, Any, None]) -> None:
    """Ctrl-C is a normal way to stop a live command: exit 0, no traceback."""
    try:
        asyncio.run(main)
    except KeyboardInterrupt:
        return
    except MusterError as exc:
        fail(str(exc))


@app.command(cls=common(*CONNECTION))
def top(
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.2, max=60.0, help="least seconds between redraws"),
    ] = 1.0,
    *,
    ctx: typer.Context,
) -> None:
    """Live view of clusters, queues, the busiest jobs and recent interruptions; without a
    terminal (a pipe, a file), one plain-text snapshot of them."""
    from broker.top import run_top, snapshot_top

    opts = CommonOptions.of(ctx).nats_options()

    async def main() -> None:
        async with MusterClient(opts) as client:
            if not sys.stdout.isatty():
                await snapshot_top(client, Console(highlight=False, width=200))
                return
            await run_top(
                client,
                Console(highlight=False),
                min_interval_s=interval,
                on_ready=lambda: err.print("muster top: live (Ctrl-C to quit)"),
            )

    run_until_interrupted(main())


@app.command(cls=common(*CONNECTION))
def logs(
    job: Annotated[str, typer.Argument(help="job id")],
    podset: Annotated[
        str | None, typer.Option("--podset", "-p", help="only this podset (e.g. worker)")
    ] = None,
    replica: Annotated[
        int | None, typer.Option("--replica", "-r", min=0, max=4095, help="only this replica")
    ] = None,
    attempt: Annotated[
        int | None,
        typer.Option("--attempt", "-a", min=1, help="this attempt (default: the latest)"),
    ] = None,
    tail: Annotated[
        int, typer.Option("--tail", min=1, max=10_000, help="lines per container")
    ] = 100,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing until the attempt ends")
    ] = False,
    *,
    ctx: typer.Context,
) -> None:
    """Print a job's container logs, read through the agent of the cluster running it."""
    from broker.logs import read_logs

    opts = CommonOptions.of(ctx).nats_options()

    async def main() -> None:
        async with MusterClient(opts) as client:
            async for lines in read_logs(
                client,
                job,
                attempt=attempt,
                podset=podset,
                replica=replica,
                tail_lines=tail,
                follow=follow,
            ):
                typer.echo("\n".join(lines))

    run_until_interrupted(main())
