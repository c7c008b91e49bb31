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
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import msgspec
import typer
from rich.console import Console, RenderableType
from rich.text import Text

from broker.cli_live import UiHost, UiPort, register_live
from broker.cli_nodeops import register_nodeops
from broker.client import MusterClient, MusterError
from broker.config import ConfigError, config_to_yaml, load_config_full
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
    EventLoopFlag,
    EventLoopOpt,
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


@app.command(short_help="Submit a JobSpec or a Kubernetes job manifest.")
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


@app.command(short_help="List jobs, or show one job.")
@with_nats_auth
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
    nats: NatsUrl = None,
    output: OutputOpt = Output.table,
    timeout: Timeout = 5.0,
    *,
    auth: NatsAuth,
) -> None:
    """List jobs (REASON says why a queued job waits), or show one job: state, attempts,
    accounting, latest checkpoint. --cluster matches jobs that run or ran there."""
    wanted = cast(JobState | None, state)
    opts = nats_options(nats, auth)
    if job is not None and not watch:
        _show(opts, output, lambda c: c.get(job, timeout=timeout), job_detail)
        return

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
    """Cancel a job (its running attempt is stopped). Cancelling a cancelled job succeeds."""

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
        nats_options(nats, auth),
        output,
        cancel_once,
        lambda view: Text.assemble(f"job {view.job_id} is ", state_text(view.state)),
    )


@app.command(short_help="Why a job waits, or where and why it runs.")
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


@app.command(short_help="Queues: jobs, usage against quota.")
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


@app.command(short_help="Clusters: health, flavors, free GPUs, prices.")
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


@app.command(short_help="Follow a job's events until it ends.")
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

    final = _run(_with_client(opts, follow))
    if exit_status and final != "succeeded":
        raise typer.Exit(1)


# -- operator commands -------------------------------------------------------------------


@app.command(short_help="Run the broker.")
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
    event_loop: EventLoopFlag = EventLoopOpt.asyncio,
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
        loop=event_loop,
    )


@app.command("store-compact", short_help="Free a full job bucket: drop ended jobs' workloads.")
@with_nats_auth
def store_compact(
    nats: NatsUrl = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="broker config YAML (its prefix)")
    ] = None,
    expire_ended_days: Annotated[
        float | None,
        typer.Option(
            "--expire-ended-days",
            help="also delete ended jobs that finished more than this many days ago (their ids "
            "may then be submitted again)",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="count, change nothing")] = False,
    *,
    auth: NatsAuth,
) -> None:
    """Free the job bucket: drop ended jobs' workloads from their records (and delete old ended
    jobs with --expire-ended-days). Works while the bucket is full and no broker leads."""
    import time

    from broker.service import connect
    from broker.store import NewerRecords, compact_bucket
    from schemas.subjects import Subjects

    try:
        prefix = load_config_full(config).config.subject_prefix
    except ConfigError as exc:
        fail(str(exc))
    opts = nats_options(nats, auth, name="muster-store-compact")
    cut = time.time() - expire_ended_days * 86_400 if expire_ended_days is not None else None

    async def run() -> None:
        nc = await connect(opts, "muster-store-compact")
        try:
            report = await compact_bucket(
                nc.jetstream(),
                Subjects(prefix=prefix).jobs_bucket,
                expire_before=cut,
                dry_run=dry_run,
            )
        except NewerRecords as exc:
            raise MusterError(f"nothing compacted: {exc}") from None
        finally:
            await nc.close()
        verb = "would compact" if dry_run else "compacted"
        out.print(
            f"{report.records} records: {verb} {report.compacted} ended, "
            f"{'would delete' if dry_run else 'deleted'} {report.expired}; bucket "
            f"{report.bytes_before:,} -> {report.bytes_after:,} bytes"
        )

    _run(run())


@app.command("config", short_help="Check a broker config; print it resolved.")
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


@app.command("nats-config", short_help="Print NATS users and permissions.")
def nats_config_cmd(
    file: Annotated[
        Path | None, typer.Argument(help="broker config YAML, or a ConfigMap holding broker.yaml")
    ] = None,
    cluster: Annotated[
        list[str] | None, typer.Option("--cluster", help="a cluster whose agent gets a user")
    ] = None,
    leaf: Annotated[
        list[str] | None,
        typer.Option(
            "--leaf",
            help="a GPU cluster that reaches NATS through a leaf node: its leaf connection "
            "gets a user, mapped from its mTLS certificate (muster-leaf-CLUSTER)",
        ),
    ] = None,
    leafnode_for: Annotated[
        str | None,
        typer.Option(
            "--leafnode-for",
            help="print the nats.conf of CLUSTER's leaf node instead (needs --hub)",
            show_default=False,
        ),
    ] = None,
    hub: Annotated[
        list[str] | None,
        typer.Option("--hub", help="the control cluster's leafnode URL (tls://HOST:7422)"),
    ] = None,
    frontdoor: Annotated[
        list[str] | None,
        typer.Option(
            "--frontdoor",
            help="CLUSTER=TEAM[,TEAM]: that cluster's agent submits for those teams "
            "(its `frontdoor` config)",
        ),
    ] = None,
) -> None:
    """Print the nats-server users and permissions (accounts.conf) for the config's teams,
    or with --leafnode-for the nats.conf of a GPU cluster's leaf node."""
    from broker.natsconfig import load_broker_config, render, render_leafnode

    if leafnode_for is not None:
        try:
            typer.echo(render_leafnode(leafnode_for, hub or []), nl=False)
        except ValueError as exc:
            fail(str(exc))
        return
    doors: dict[str, list[str]] = {}
    for item in frontdoor or []:
        name, sep, teams = item.partition("=")
        if not sep or not name or not teams:
            fail(f"--frontdoor {item!r}: write CLUSTER=TEAM[,TEAM], e.g. east=research")
        doors.setdefault(name, []).extend(t for t in teams.split(",") if t)
    try:
        loaded = load_broker_config(file)
        text = render(loaded.config, cluster or [], loaded.aliases, leaf or [], doors)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    typer.echo(text, nl=False)


BackupConfig = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="the broker config (its subject prefix and replicas)"),
]


async def _bucket_job(opts: NatsOptions, fn: Callable[[Any], Awaitable[T]]) -> T:
    import nats as nats_py

    from broker.backup import BackupError

    try:
        nc = await nats_py.connect(**{**opts.connect_kwargs(), "max_reconnect_attempts": 2})
    except Exception as exc:
        raise MusterError(f"cannot reach NATS at {opts.url}: {exc}") from None
    try:
        return await fn(nc)
    except BackupError as exc:
        raise MusterError(str(exc)) from None
    finally:
        await nc.close()


def _load_config(path: Path | None) -> Any:
    try:
        return load_config_full(path)
    except ConfigError as exc:
        fail(str(exc))


@app.command("jobs-backup", short_help="Back up every job record to FILE; the broker may run.")
@with_nats_auth
def jobs_backup(
    file: Annotated[Path, typer.Argument(help="the backup file to write (JSON lines)")],
    config: BackupConfig = None,
    nats: NatsUrl = None,
    *,
    auth: NatsAuth,
) -> None:
    """Back up every job record of the job bucket to FILE (the broker may keep running)."""
    from broker.backup import backup

    loaded = _load_config(config)
    got = _run(_bucket_job(nats_options(nats, auth), lambda nc: backup(nc, loaded.config, file)))
    typer.echo(f"backed up {got.records} job records (bucket sequence {got.last_seq}) to {file}")


@app.command("jobs-restore", short_help="Restore the job bucket from FILE, with no broker leading.")
@with_nats_auth
def jobs_restore(
    file: Annotated[Path, typer.Argument(help="a file written by `muster jobs-backup`")],
    config: BackupConfig = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="overwrite a bucket that already holds records")
    ] = False,
    nats: NatsUrl = None,
    *,
    auth: NatsAuth,
) -> None:
    """Restore the job bucket from FILE; run it with no broker leading, then start them."""
    from broker.backup import restore

    loaded = _load_config(config)
    got = _run(
        _bucket_job(
            nats_options(nats, auth),
            lambda nc: restore(nc, loaded.config, file, replace=replace),
        )
    )
    typer.echo(f"restored {got.records} job records from {file}")


@app.command()
def schema() -> None:
    """Print the JSON Schema of the client-facing messages."""
    from schemas.jsonschema import render

    typer.echo(render(), nl=False)


register_live(app)
register_nodeops(app, print_json)


tidy_help(app)


def main() -> None:
    """Console-script entry point of the broker's commands alone (`muster` is muster.cli)."""
    app()


if __name__ == "__main__":
    main()
