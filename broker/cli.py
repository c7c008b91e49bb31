"""The broker's part of the `muster` command line: the user commands (submit, status, cancel,
why, queues, clusters, watch) and the broker's operator commands (broker, config, nats-config,
schema). The agent's commands are in agents/cli.py; muster/cli.py joins them into `muster`.

Client commands reach NATS at --nats, else $MUSTER_NATS, else the URL an embedded broker wrote
to <state dir>/nats.url, else nats://127.0.0.1:4222. `--output json` prints the exact reply
Structs for scripts. A user error prints one line on stderr and exits 1; usage errors exit 2.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from broker.cli_live import UiHost, UiPort, register_live
from broker.client import MusterClient, MusterError
from broker.config import ConfigError, config_to_yaml, load_config_full
from broker.manifests import JobDocumentError, load_job_documents
from schemas.api import (
    ClusterView,
    FlavorView,
    JobEvent,
    JobView,
    QueueView,
    SubmitReply,
    WhyView,
)
from schemas.natsopts import NatsOptions
from shell.cli import (
    LogFormatFlag,
    LogLevel,
    LogLevelOpt,
    NatsAuth,
    NatsUrl,
    as_coroutine,
    err,
    fail,
    nats_options,
    serve,
    server_nats,
    tidy_help,
    with_nats_auth,
)
from shell.logs import configure_logging
from shell.natsio import default_state_dir

T = TypeVar("T")

app = typer.Typer(
    name="muster",
    help="Muster: gang admission of GPU training jobs across clusters, over NATS.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_show_locals=False,  # never print a password held in a local
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Muster: gang admission of GPU training jobs across clusters, over NATS."""


class _Out:
    """stdout through rich, made per print so it follows sys.stdout (pipes, test runners);
    when piped, a wide fixed width so tables are not wrapped at 80 columns."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        width = None if sys.stdout.isatty() else 200
        Console(highlight=False, width=width).print(*objects, **kwargs)


out = _Out()


class Output(StrEnum):
    table = "table"
    json = "json"


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


# -- shared options ----------------------------------------------------------------------

OutputOpt = Annotated[
    Output, typer.Option("--output", "-o", help="table for people, json for scripts")
]
Timeout = Annotated[float, typer.Option("--timeout", help="seconds to wait for the broker")]


def _run(coro: Awaitable[T]) -> T:
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
    opts: NatsOptions,
    output: Output,
    fetch: Callable[[MusterClient], Awaitable[T]],
    render: Callable[[T], RenderableType],
) -> None:
    """One request to the broker; its answer as JSON for scripts or rendered for people."""
    result = _run(_with_client(opts, fetch))
    if output is Output.json:
        print_json(result)
    else:
        out.print(render(result))


def print_json(obj: Any) -> None:
    """The exact Struct(s) as pretty JSON (plain stdout: never wrapped or styled)."""
    typer.echo(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


# -- formatting (pure: Structs in, rich renderables out) ---------------------------------

_STATE_STYLE = {
    "queued": "yellow",
    "admitted": "cyan",
    "running": "green",
    "preempting": "magenta",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "dim",
    "checkpointed": "blue",
    "requeued": "yellow",
    "restarted": "magenta",
}


def _state(state: str) -> Text:
    return Text(state, style=_STATE_STYLE.get(state, ""))


def fmt_ago(ts: float | None, now: float) -> str:
    """`12s ago`, `3m ago`, `2h ago`, `4d ago`; '-' when unknown."""
    if not ts:
        return "-"
    return f"{fmt_duration(max(0.0, now - ts))} ago"


def fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def fmt_gpu_hours(gpu_seconds: float) -> str:
    return f"{gpu_seconds / 3600:.2f}"


def _where(cluster: str | None, flavor: str | None) -> str:
    if not cluster:
        return flavor or "-"
    return f"{cluster}/{flavor}" if flavor else cluster


def _row(table: Table, *cells: str | Text) -> None:
    """Add a row; plain strings become Text so '[...]' in a reason is never read as markup."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def _last_where(j: JobView) -> str:
    """Where the job runs now, else where it last ran (an ended or requeued job)."""
    if j.cluster:
        return _where(j.cluster, j.flavor)
    if j.attempts:
        last = j.attempts[-1]
        return f"{_where(last.cluster, last.flavor)} (last)"
    return "-"


def jobs_table(jobs: Sequence[JobView], now: float | None = None) -> Table:
    """`muster status`: one row per job; REASON is the short form of `muster why`."""
    now = time.time() if now is None else now
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("JOB", "NAME", "QUEUE", "STATE", "GPUS", "ATTEMPT", "WHERE", "SUBMITTED"):
        table.add_column(col, no_wrap=True)
    table.add_column("REASON", overflow="fold")
    for j in jobs:
        _row(
            table,
            j.job_id,
            j.name,
            j.queue,
            _state(j.state),
            str(j.gpus),
            str(j.attempt) if j.attempt else "-",
            _last_where(j),
            fmt_ago(j.submitted_at, now),
            j.waiting or j.reason or "",
        )
    return table


def job_detail(job: JobView, now: float | None = None) -> Group:
    """`muster status JOB`: state, attempts, accounting and the latest checkpoint."""
    now = time.time() if now is None else now
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    _row(head, "job", job.job_id)
    _row(head, "name", job.name)
    _row(head, "queue", job.queue)
    state = _state(job.state)
    if job.reason:
        state.append(f"  ({job.reason})", style="")
    _row(head, "state", state)
    _row(head, "priority", str(job.priority))
    _row(head, "gpus", str(job.gpus))
    _row(head, "submitted", fmt_ago(job.submitted_at, now))
    if job.attempt:
        _row(head, "attempt", f"{job.attempt} on {_where(job.cluster, job.flavor)}")
    if job.spec is not None and job.spec.gang:
        _row(
            head,
            "gang",
            ", ".join(
                f"{p.name} x{p.replicas} ({p.gpu} gpu, {p.cpu} cpu, {p.memory})"
                for p in job.spec.gang
            ),
        )
    parts: list[RenderableType] = [head]

    if job.attempts:
        attempts = Table(title="attempts", title_justify="left", box=None, header_style="bold")
        for col in ("#", "CLUSTER", "FLAVOR", "CAPACITY", "GPU", "DISPATCHED", "RAN", "ENDED"):
            attempts.add_column(col, no_wrap=True)
        for col in ("CAUSE", "RESUMED", "GPU-H", "LOST GPU-H", "COST"):
            attempts.add_column(col, no_wrap=True)
        for a in job.attempts:
            _row(
                attempts,
                str(a.attempt),
                a.cluster,
                a.flavor,
                a.capacity_type or "-",
                a.gpu_type or "-",
                fmt_ago(a.dispatched_at, now),
                fmt_duration((a.ended_at or now) - a.running_at) if a.running_at else "-",
                fmt_ago(a.ended_at, now) if a.ended_at else "-",
                a.end_cause or ("-" if a.ended_at is None else ""),
                f"step {a.resume_from_step}" if a.resume_from_step is not None else "-",
                fmt_gpu_hours(a.gpu_seconds),
                fmt_gpu_hours(a.gpu_seconds_lost),
                f"${a.cost:.2f}",
            )
        parts.append(Text(""))
        parts.append(attempts)

    acc = job.accounting
    parts.append(Text(""))
    parts.append(
        Text.assemble(
            ("accounting  ", "bold"),
            f"attempts {acc.attempts}, preemptions {acc.preemptions}, errors {acc.errors}, "
            f"GPU-hours used {fmt_gpu_hours(acc.gpu_seconds_used)}, "
            f"lost {fmt_gpu_hours(acc.gpu_seconds_lost)}, goodput {acc.goodput:.0%}, "
            f"cost ${acc.cost:.2f}",
        )
    )
    ck = job.latest_checkpoint
    if ck is not None:
        when = f", {fmt_ago(ck.at, now)}" if ck.at else ""
        by = f", attempt {ck.attempt}" if ck.attempt else ""
        parts.append(
            Text.assemble(("checkpoint  ", "bold"), f"step {ck.step} at {ck.uri}{when}{by}")
        )
    else:
        parts.append(Text.assemble(("checkpoint  ", "bold"), "none yet"))
    return Group(*parts)


def why_view(why: WhyView) -> Group:
    """`muster why JOB`: position, what it waits for, and per cluster x flavor what binds."""
    lines: list[RenderableType] = []
    head = Text.assemble((why.job_id, "bold"), " is ", _state(why.state))
    if why.position is not None:
        where = f" in queue {why.queue}" if why.queue else " in its queue"
        ahead = "at the head" if why.position == 0 else f"{why.position} ahead of it"
        head.append(f", position {why.position}{where} ({ahead})")
    lines.append(head)
    if why.waiting_for:
        lines.append(Text(f"waiting for: {why.waiting_for}"))
    if not why.reasons and not why.candidates:
        if why.state == "queued":
            lines.append(Text("no reason recorded yet; the next scheduling cycle will say"))
        else:
            lines.append(Text("nothing holds it back"))
    for r in why.reasons:
        where = _where(r.cluster, r.flavor)
        prefix = f"  [{r.code}] " + (f"{where}: " if where != "-" else "")
        lines.append(Text(prefix + r.message))  # Text: never parsed as markup
    if why.candidates:
        table = Table(box=None, pad_edge=False, header_style="bold")
        table.add_column("CLUSTER/FLAVOR", no_wrap=True)
        table.add_column("CONSTRAINT", no_wrap=True)
        bound = any(c.bound is not None for c in why.candidates)
        if bound:  # the binding numbers: used + needed > limit
            table.add_column("BINDING", no_wrap=True)
        table.add_column("DETAIL", overflow="fold")
        for c in why.candidates:
            cells = [_where(c.cluster, c.flavor), c.code]
            if bound:
                b = c.bound
                binding = "-"
                if b is not None:
                    k, unit = (2**30, "Gi") if b.resource == "memory" else (1, "")
                    used, needed, limit = (f"{v / k:g}{unit}" for v in (b.used, b.needed, b.limit))
                    binding = f"{b.resource} {used}+{needed}>{limit}"
                cells.append(binding)
            _row(table, *cells, c.message)
        lines.append(Text(""))
        lines.append(table)
    return Group(*lines)


def _amount(resource: str, value: int | None) -> str:
    if value is None:
        return "∞"
    if resource == "cpu":
        return f"{value / 1000:g}"
    if resource == "memory":
        for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20)):
            if value >= size:
                return f"{value / size:.3g}{suffix}"
        return str(value)
    return str(value)


def queues_table(queues: Sequence[QueueView]) -> Table:
    """`muster queues`: usage against quota per flavor class and resource."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("QUEUE", "COHORT", "STRATEGY", "WEIGHT", "PENDING", "ADMITTED", "SHARE"):
        table.add_column(col, no_wrap=True)
    table.add_column("USAGE (used/nominal, +borrowed, lent)", overflow="fold")
    for q in queues:
        usage = []
        for f in q.flavors:
            res = []
            for r in f.resources:
                cell = (
                    f"{r.resource} {_amount(r.resource, r.used)}/{_amount(r.resource, r.nominal)}"
                )
                if r.borrowed:
                    cell += f" +{_amount(r.resource, r.borrowed)}"
                if r.lent:
                    cell += f" lent {_amount(r.resource, r.lent)}"
                res.append(cell)
            usage.append(f"{f.flavor}: " + ", ".join(res))
        _row(
            table,
            q.name,
            q.cohort or "-",
            q.strategy,
            f"{q.weight:g}",
            str(q.pending),
            str(q.admitted),
            f"{q.dominant_share:.0%}",
            "; ".join(usage) or "no quota (unlimited)",
        )
    return table


_HEALTH_STYLE = {"healthy": "green", "unreachable": "yellow", "lost": "red"}


def _interruptions(f: FlavorView) -> str:
    """The estimate and what it rests on: the prior alone until a notice has been seen."""
    if f.interruptions == 0 and f.interruption_prior is not None:
        return f"prior {f.interruption_prior:g}/node-h, 0 observed"
    if f.interruptions == 0 and f.interruption_rate_per_node_hour == 0:
        return "-"
    return f"{f.interruption_rate_per_node_hour:.3f}/node-h, {f.interruptions} observed"


def clusters_table(clusters: Sequence[ClusterView], now: float | None = None) -> Table:
    """`muster clusters`: one row per cluster flavor, with capacity and spot risk."""
    now = time.time() if now is None else now
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("CLUSTER", "HEALTH", "HEARTBEAT", "JOBS", "FLAVOR", "CAPACITY", "GPU"):
        table.add_column(col, no_wrap=True)
    for col in ("$/GPU-H", "NODES", "GPUS FREE/TOTAL", "DRAINING", "INTERRUPTIONS/NODE-H"):
        table.add_column(col, no_wrap=True)
    for c in clusters:
        health = Text(c.health, style=_HEALTH_STYLE.get(c.health, ""))
        if c.stale_s > 0:  # the agent cannot see its cluster: nothing is placed there
            health = Text(f"{c.health}, stale {c.stale_s:.0f}s", style="yellow")
        common: list[str | Text] = [
            c.name,
            health,
            fmt_ago(c.last_heartbeat, now),
            str(c.running_jobs),
        ]
        if not c.flavors:
            _row(table, *common, "-", "-", "-", "-", "0", "0/0", "0", "-")
        for i, f in enumerate(c.flavors):
            lead: list[Any] = common if i == 0 else ["", "", "", ""]
            _row(
                table,
                *lead,
                f.name,
                f.capacity_type,
                f.gpu_type or "-",
                f"{f.price_per_gpu_hour:.2f}",
                str(f.nodes),
                f"{f.gpu_free}/{f.gpu_total}",
                str(f.draining_nodes),
                _interruptions(f),
            )
    return table


def event_line(ev: JobEvent) -> Text:
    """One line per lifecycle event for `muster watch`."""
    clock = time.strftime("%H:%M:%S", time.localtime(ev.at)) if ev.at else "--:--:--"
    text = Text(f"{clock}  ")
    text.append(f"{ev.kind:<12}", style=_STATE_STYLE.get(ev.kind, ""))
    text.append(" ")  # a kind as long as the column must not run into its details
    details = []
    if ev.attempt:
        details.append(f"attempt {ev.attempt}")
    if ev.cluster:
        details.append(f"on {_where(ev.cluster, ev.flavor)}")
    if ev.step is not None:
        details.append(f"step {ev.step}")
    if ev.resume_from_step is not None:
        details.append(f"resuming from step {ev.resume_from_step}")
    if ev.reason:
        details.append(f"({ev.reason})")
    text.append(" ".join(details))
    return text


def submit_line(reply: SubmitReply, queue: str) -> str:
    if reply.duplicate:
        return f"job {reply.job_id} was already submitted to queue {queue}; nothing new created"
    return f"submitted job {reply.job_id} to queue {queue}"


# -- client commands ---------------------------------------------------------------------


@app.command()
@with_nats_auth
def submit(
    file: Annotated[
        str, typer.Argument(help="job file (YAML/JSON JobSpec or manifest); - = stdin")
    ],
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="queue to submit to")] = None,
    job_id: Annotated[
        str | None, typer.Option("--job-id", help="idempotency key: a repeat is not run twice")
    ] = None,
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    timeout: Timeout = 5.0,
    *,
    auth: NatsAuth,
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
    # A job naming no queue goes to the broker's `default` queue.
    if len(specs) == 1:
        (spec,) = specs
        _show(
            nats_options(nats, auth),
            output,
            lambda c: c.submit(spec, timeout=timeout),
            lambda reply: submit_line(reply, spec.queue or "default"),
        )
        return

    async def submit_all(c: MusterClient) -> list[SubmitReply]:
        """A multi-document file: one submission per job (a pod group is one job)."""
        return [await c.submit(one, timeout=timeout) for one in specs]

    _show(
        nats_options(nats, auth),
        output,
        submit_all,
        lambda replies: "\n".join(
            submit_line(r, one.queue or "default") for r, one in zip(replies, specs, strict=True)
        ),
    )


@app.command()
@with_nats_auth
def status(
    job: Annotated[str | None, typer.Argument(help="a job id; omit to list jobs")] = None,
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="only this queue")] = None,
    state: Annotated[State | None, typer.Option("--state", help="only this state")] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", help="only this cluster")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 1000,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="refresh the list until Ctrl-C")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="seconds between refreshes (--watch)")
    ] = 2.0,
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    timeout: Timeout = 5.0,
    *,
    auth: NatsAuth,
) -> None:
    """List jobs (REASON says why a queued job waits), or show one job: state, attempts,
    accounting, latest checkpoint. --cluster matches jobs that run or ran there."""
    opts = nats_options(nats, auth)
    if job is not None and not watch:
        _show(opts, output, lambda c: c.get(job, timeout=timeout), job_detail)
        return

    def fetch(c: MusterClient) -> Awaitable[list[JobView]]:
        return c.list(
            queue=queue,
            state=state.value if state else None,
            cluster=cluster,
            limit=limit,
            timeout=timeout,
        )

    def render(jobs: list[JobView]) -> RenderableType:
        return jobs_table(jobs) if jobs else Text("no jobs")

    if not watch:
        jobs = _run(_with_client(opts, fetch))
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

    _run(_with_client(opts, refresh))


@app.command()
@with_nats_auth
def cancel(
    job: Annotated[str, typer.Argument(help="job id")],
    reason: Annotated[str, typer.Option("--reason", help="recorded with the job")] = (
        "cancelled by user"
    ),
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    timeout: Timeout = 5.0,
    *,
    auth: NatsAuth,
) -> None:
    """Cancel a job (its running attempt is stopped)."""
    _show(
        nats_options(nats, auth),
        output,
        lambda c: c.cancel(job, reason, timeout=timeout),
        lambda view: Text.assemble(f"job {view.job_id} is ", _state(view.state)),
    )


@app.command()
@with_nats_auth
def why(
    job: Annotated[str, typer.Argument(help="job id")],
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    timeout: Timeout = 5.0,
    *,
    auth: NatsAuth,
) -> None:
    """Say why a job is not admitted (quota, capacity, GPU type, queue order, ...)."""
    _show(nats_options(nats, auth), output, lambda c: c.why(job, timeout=timeout), why_view)


@app.command()
@with_nats_auth
def queues(
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    timeout: Timeout = 5.0,
    *,
    auth: NatsAuth,
) -> None:
    """Show queues: pending and admitted jobs, usage against quota, fair share."""
    _show(nats_options(nats, auth), output, lambda c: c.queues(timeout=timeout), queues_table)


@app.command()
@with_nats_auth
def clusters(
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    timeout: Timeout = 5.0,
    *,
    auth: NatsAuth,
) -> None:
    """Show clusters: health, flavors, free GPUs, prices and spot interruption rates."""
    _show(nats_options(nats, auth), output, lambda c: c.clusters(timeout=timeout), clusters_table)


def current_line(view: JobView, now: float | None = None) -> Text:
    """`muster watch`'s first line: where the job stands before any new event."""
    now = time.time() if now is None else now
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    text = Text(f"{clock}  ")
    text.append(f"{'now ' + view.state:<12}", style=_STATE_STYLE.get(view.state, ""))
    text.append(" ")
    details = []
    if view.attempt:
        details.append(f"attempt {view.attempt}")
    where = _last_where(view)
    if where != "-":
        details.append(f"on {where}")
    if view.latest_checkpoint is not None:
        details.append(f"checkpoint step {view.latest_checkpoint.step}")
    note = view.waiting or view.reason
    if note:
        details.append(f"({note})")
    text.append(" ".join(details))
    return text


@app.command()
@with_nats_auth
def watch(
    job: Annotated[str, typer.Argument(help="job id")],
    exit_status: Annotated[
        bool,
        typer.Option(
            "--exit-status", help="exit 1 unless the job succeeded (default: 0 once it ended)"
        ),
    ] = False,
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    *,
    auth: NatsAuth,
) -> None:
    """Print a job's current state, then its events one per line until it ends.

    Exits 0 once the job has ended (with --exit-status: only if it succeeded)."""
    opts = nats_options(nats, auth)

    def show_current(view: JobView) -> None:
        if output is not Output.json:
            out.print(current_line(view))
        elif view.state in _ENDED:  # JSON lines are events; an ended job prints its view
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

    final = _run(_with_client(opts, follow))
    if exit_status and final != "succeeded":
        raise typer.Exit(1)


_ENDED = frozenset({"succeeded", "failed", "cancelled"})


# -- operator commands -------------------------------------------------------------------


@app.command()
@with_nats_auth
def broker(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="broker config YAML (default: built-in)")
    ] = None,
    nats: Annotated[
        str | None,
        typer.Option(
            "--nats",
            envvar="MUSTER_NATS",
            help="NATS URL of an existing server; without it an embedded nats-server starts and "
            "its URL is written to <state dir>/nats.url",
            show_default=False,
        ),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            "--state-dir",
            help="where the embedded NATS keeps its data and nats.url "
            "(default: $MUSTER_STATE_DIR or ./.muster)",
            show_default=False,
        ),
    ] = None,
    log_level: LogLevelOpt = LogLevel.info,
    log_format: LogFormatFlag = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            help="serve Prometheus metrics on 127.0.0.1:PORT/metrics (off by default)",
            show_default=False,
        ),
    ] = None,
    ui_port: UiPort = None,
    ui_host: UiHost = "127.0.0.1",
    *,
    auth: NatsAuth,
) -> None:
    """Run the broker (queues, gang admission, dispatch, recovery)."""
    configure_logging(log_level.value, log_format.value if log_format else None)
    try:
        loaded = load_config_full(config)
    except ConfigError as exc:
        fail(str(exc))
    for note in loaded.notes:
        err.print(Text(f"note: {note}", style="dim"))
    opts = server_nats(nats, auth, name="muster-broker", resolve=False)
    from broker.service import run_broker  # the server's imports, only when it runs

    serve(
        run_broker(
            config=loaded.config,
            nats=opts,
            state_dir=state_dir or default_state_dir(),
            metrics_port=metrics_port,
            ui_port=ui_port,
            ui_host=ui_host,
        ),
        user_errors=(ConfigError, MusterError, ValueError),  # configs, traces, settings
    )


@app.command("config")
def config_cmd(
    file: Annotated[Path, typer.Argument(help="broker config YAML (may import Kueue/Volcano)")],
    output: Annotated[ConfigOutput, typer.Option("--output", "-o")] = ConfigOutput.yaml,
) -> None:
    """Check a broker config and print it resolved (imports applied, quantities normalised)."""
    try:
        loaded = load_config_full(file)
    except ConfigError as exc:
        fail(str(exc))
    for note in loaded.notes:
        err.print(Text(f"note: {note}", style="dim"))
    if output is ConfigOutput.json:
        data = msgspec.to_builtins(loaded.config)
        if loaded.aliases:
            data["queue_aliases"] = loaded.aliases
        print_json(data)
    else:
        typer.echo(config_to_yaml(loaded.config, loaded.aliases), nl=False)


@app.command("nats-config")
def nats_config_cmd(
    file: Annotated[
        Path | None, typer.Argument(help="broker config YAML, or a ConfigMap holding broker.yaml")
    ] = None,
    cluster: Annotated[
        list[str] | None, typer.Option("--cluster", help="a cluster whose agent gets a user")
    ] = None,
) -> None:
    """Print the nats-server users and permissions (accounts.conf) for the config's teams."""
    from broker.natsconfig import load_broker_config, render

    try:
        loaded = load_broker_config(file)
    except ConfigError as exc:
        fail(str(exc))
    typer.echo(render(loaded.config, cluster or [], loaded.aliases), nl=False)


@app.command()
def schema() -> None:
    """Print the JSON Schema of the client-facing messages."""
    from schemas.jsonschema import render

    typer.echo(render(), nl=False)


register_live(app)


tidy_help(app)


def main() -> None:
    """Console-script entry point of the broker's commands alone (`muster` is muster.cli)."""
    app()


if __name__ == "__main__":
    main()
