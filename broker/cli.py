"""The user commands of the `muster` command line (submit, status, cancel, why, queues,
clusters, watch). The operator's are in broker/cli_operator.py, cli_live.py and
cli_nodeops.py, the agent's in agents/cli.py; muster/cli.py lists them all as `muster`.

Client commands reach NATS at --nats, else $MUSTER_NATS, else the URL an embedded broker wrote
to <state dir>/nats.url, else nats://127.0.0.1:4222. `--output json` prints the exact reply
Structs for scripts. A user error prints one line on stderr and exits 1; usage errors exit 2.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import msgspec
import typer
from rich.console import Console, RenderableType
from rich.text import Text

from broker.client import MusterClient, MusterError
from broker.config import ConfigError
from broker.manifests import JobDocumentError, load_job_documents
from broker.render import (
    clusters_table,
    current_line,
    event_line,
    job_detail,
    jobs_table,
    queues_table,
    state_text,
    submit_line,
    why_view,
)
from schemas.api import (
    TERMINAL_STATES,
    JobState,
    JobView,
    SubmitReply,
)
from schemas.natsopts import NatsOptions
from shell.cli import (
    CONNECTION,
    REQUEST,
    CommonOptions,
    Output,
    as_coroutine,
    common,
    fail,
)

T = TypeVar("T")

# The commands of this module; muster/cli.py lists them in `muster` and loads this module when
# one of them runs.
app = typer.Typer(rich_markup_mode=None, pretty_exceptions_show_locals=False)


class _Out:
    """stdout through rich, made per print so it follows sys.stdout (pipes, test runners);
    when piped, a wide fixed width so tables are not wrapped at 80 columns."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        width = None if sys.stdout.isatty() else 200
        Console(highlight=False, width=width).print(*objects, **kwargs)


out = _Out()


class ConfigOutput(StrEnum):
    yaml = "yaml"
    json = "json"


class State(StrEnum):
    queued = "queued"
    admitted = "admitted"
    running = "running"
    preempting = "preempting"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


# Words people use for a state, as kubectl and Kueue say them.
STATE_ALIASES = {
    "pending": "queued",
    "waiting": "queued",
    "canceled": "cancelled",
    "complete": "succeeded",
    "completed": "succeeded",
    "error": "failed",
}


def _state(text: str | None) -> str | None:
    """A job state from what the user typed (case-insensitive; aliases such as `pending`); a
    usage error listing the states otherwise."""
    if text is None:
        return None
    word = text.strip().lower()
    word = STATE_ALIASES.get(word, word)
    if word not in State.__members__:
        known = ", ".join(s.value for s in State)
        raise typer.BadParameter(
            f"{text!r} is not a job state; use one of: {known} (pending = queued)"
        )
    return word


def run_request(coro: Awaitable[T]) -> T:
    """Run a coroutine; user-facing errors become one line on stderr and exit 1."""
    try:
        return asyncio.run(as_coroutine(coro))
    except (MusterError, JobDocumentError, ConfigError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


async def _with_client(opts: NatsOptions, fn: Callable[[MusterClient], Awaitable[T]]) -> T:
    async with MusterClient(opts) as client:
        return await fn(client)


def _show(
    common: CommonOptions,
    fetch: Callable[[MusterClient], Awaitable[T]],
    render: Callable[[T], RenderableType],
) -> None:
    """One request to the broker; its answer as JSON for scripts or rendered for people."""
    result = run_request(_with_client(common.nats_options(), fetch))
    if common.output is Output.json:
        print_json(result)
    else:
        out.print(render(result))


def print_json(obj: Any) -> None:
    """The exact Struct(s) as pretty JSON (plain stdout: never wrapped or styled)."""
    typer.echo(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


@app.command(cls=common(*REQUEST))
def submit(
    file: Annotated[
        str, typer.Argument(help="job file (YAML/JSON JobSpec or manifest); - = stdin")
    ],
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="queue to submit to")] = None,
    job_id: Annotated[
        str | None, typer.Option("--job-id", help="idempotency key: a repeat is not run twice")
    ] = None,
    *,
    ctx: typer.Context,
) -> None:
    """Submit a job: a Muster JobSpec, or a PyTorchJob/MPIJob/TFJob/Volcano Job/JobSet/Job."""
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"{file}: cannot read the job file: {exc.strerror or exc}")
    except UnicodeDecodeError:
        fail(f"{file}: not a text file; give a YAML or JSON job file")
    source = "stdin" if file == "-" else file
    try:
        specs = load_job_documents(text, queue=queue, job_id=job_id, source=source)
    except JobDocumentError as exc:
        fail(str(exc))
    common = CommonOptions.of(ctx)
    timeout = common.timeout
    # A job naming no queue goes to the broker's `default` queue.
    if len(specs) == 1:
        (spec,) = specs
        _show(
            common,
            lambda c: c.submit(spec, timeout=timeout),
            lambda reply: submit_line(reply, spec.queue or "default"),
        )
        return

    async def submit_all(c: MusterClient) -> list[SubmitReply]:
        """A multi-document file: one submission per job (a pod group is one job)."""
        return [await c.submit(one, timeout=timeout) for one in specs]

    _show(
        common,
        submit_all,
        lambda replies: "\n".join(
            submit_line(r, one.queue or "default") for r, one in zip(replies, specs, strict=True)
        ),
    )


@app.command(cls=common(*REQUEST))
def status(
    job: Annotated[str | None, typer.Argument(help="a job id; omit to list jobs")] = None,
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="only this queue")] = None,
    state: Annotated[
        str | None,
        typer.Option(
            "--state",
            help="only this state: " + ", ".join(s.value for s in State) + " (pending = queued)",
            callback=_state,
        ),
    ] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", help="only this cluster")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 1000,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="refresh the list until Ctrl-C")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="seconds between refreshes (--watch)")
    ] = 2.0,
    *,
    ctx: typer.Context,
) -> None:
    """List jobs (REASON says why a queued job waits), or show one job: state, attempts,
    accounting, latest checkpoint. --cluster matches jobs that run or ran there."""
    wanted = cast(JobState | None, state)
    common = CommonOptions.of(ctx)
    output, timeout = common.output, common.timeout
    if job is not None and not watch:
        _show(common, lambda c: c.get(job, timeout=timeout), job_detail)
        return
    opts = common.nats_options()

    def fetch(c: MusterClient) -> Awaitable[list[JobView]]:
        return c.list(
            queue=queue,
            state=wanted,
            cluster=cluster,
            limit=limit,
            timeout=timeout,
        )

    def render(jobs: list[JobView]) -> RenderableType:
        return jobs_table(jobs) if jobs else Text("no jobs")

    if not watch:
        jobs = run_request(_with_client(opts, fetch))
        if output is Output.json:
            print_json(jobs)
        else:
            out.print(render(jobs))
        return

    async def refresh(c: MusterClient) -> None:
        if output is Output.json:  # one JSON array per line per refresh
            while True:
                typer.echo(msgspec.json.encode(await fetch(c)).decode())
                await asyncio.sleep(interval)
        from rich.live import Live

        with Live(console=Console(highlight=False), auto_refresh=False) as live:
            while True:
                if job is not None:
                    live.update(job_detail(await c.get(job, timeout=timeout)), refresh=True)
                else:
                    live.update(render(await fetch(c)), refresh=True)
                await asyncio.sleep(interval)

    run_request(_with_client(opts, refresh))


@app.command(cls=common(*REQUEST))
def cancel(
    job: Annotated[str, typer.Argument(help="job id")],
    reason: Annotated[str, typer.Option("--reason", help="recorded with the job")] = (
        "cancelled by user"
    ),
    *,
    ctx: typer.Context,
) -> None:
    """Cancel a job (its running attempt is stopped). Cancelling a cancelled job succeeds."""
    common = CommonOptions.of(ctx)
    timeout = common.timeout

    async def cancel_once(c: MusterClient) -> JobView:
        """Idempotent, as `kubectl delete --ignore-not-found`: a job already cancelled is
        what was asked for (exit 0); one that succeeded or failed is an error (exit 1)."""
        try:
            return await c.cancel(job, reason, timeout=timeout)
        except MusterError:
            view = await c.get(job, timeout=timeout)
            if view.state != "cancelled":
                raise
            return view

    _show(
        common,
        cancel_once,
        lambda view: Text.assemble(f"job {view.job_id} is ", state_text(view.state)),
    )


@app.command(cls=common(*REQUEST))
def why(
    job: Annotated[str, typer.Argument(help="job id")],
    *,
    ctx: typer.Context,
) -> None:
    """Say why a job is not admitted (quota, capacity, GPU type, queue order, ...)."""
    common = CommonOptions.of(ctx)
    _show(common, lambda c: c.why(job, timeout=common.timeout), why_view)


@app.command(cls=common(*REQUEST))
def queues(
    *,
    ctx: typer.Context,
) -> None:
    """Show queues: pending and admitted jobs, usage against quota, fair share."""
    common = CommonOptions.of(ctx)
    _show(common, lambda c: c.queues(timeout=common.timeout), queues_table)


@app.command(cls=common(*REQUEST))
def clusters(
    *,
    ctx: typer.Context,
) -> None:
    """Show clusters: health, flavors, free GPUs, prices and spot interruption rates."""
    common = CommonOptions.of(ctx)
    _show(common, lambda c: c.clusters(timeout=common.timeout), clusters_table)


@app.command(cls=common(*CONNECTION, "output"))
def watch(
    job: Annotated[str, typer.Argument(help="job id")],
    exit_status: Annotated[
        bool,
        typer.Option(
            "--exit-status", help="exit 1 unless the job succeeded (default: 0 once it ended)"
        ),
    ] = False,
    *,
    ctx: typer.Context,
) -> None:
    """Print a job's current state, then its events one per line until it ends.

    Exits 0 once the job has ended (with --exit-status: only if it succeeded)."""
    common = CommonOptions.of(ctx)
    opts, output = common.nats_options(), common.output

    def show_current(view: JobView) -> None:
        if output is not Output.json:
            out.print(current_line(view))
        elif view.state in TERMINAL_STATES:  # JSON lines are events; an ended job prints its view
            print_json(view)

    async def follow(client: MusterClient) -> str:
        final = ""
        current: list[JobView] = []
        async for ev in client.watch(job, on_current=current.append):
            if current:
                show_current(current.pop())
            final = ev.state
            if output is Output.json:
                typer.echo(msgspec.json.encode(ev).decode())
            else:
                out.print(event_line(ev))
        if current:  # it had ended before we subscribed
            show_current(current.pop())
        if not final:
            final = (await client.get(job)).state
        return final

    final = run_request(_with_client(opts, follow))
    if exit_status and final != "succeeded":
        raise typer.Exit(1)
