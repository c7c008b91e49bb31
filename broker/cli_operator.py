"""The broker's operator commands (`muster broker`, `config`, `nats-config`, `schema`, and the
job bucket's `store-compact`, `jobs-backup`, `jobs-restore`), kept apart from the user commands
in broker.cli."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import typer
from rich.text import Text

from broker.cli import out, print_json, run_request
from broker.cli_live import UiHost, UiPort
from broker.client import MusterError
from broker.config import ConfigError, config_to_yaml, load_config_full
from schemas.natsopts import NatsOptions
from shell.cli import (
    AUTH,
    CONNECTION,
    CommonOptions,
    EventLoopFlag,
    EventLoopOpt,
    HelpCommand,
    LogFormatFlag,
    LogLevel,
    LogLevelOpt,
    common,
    err,
    fail,
    serve,
)
from shell.logs import configure_logging
from shell.natsio import default_state_dir

T = TypeVar("T")

app = typer.Typer(rich_markup_mode=None, pretty_exceptions_show_locals=False)


class ConfigOutput(StrEnum):
    yaml = "yaml"
    json = "json"


@app.command(cls=common(*AUTH))
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
    ctx: typer.Context,
) -> None:
    """Run the broker (queues, gang admission, dispatch, recovery)."""
    configure_logging(log_level.value, log_format.value if log_format else None)
    try:
        loaded = load_config_full(config)
    except ConfigError as exc:
        fail(str(exc))
    for note in loaded.notes:
        err.print(Text(f"note: {note}", style="dim"))
    given = dataclasses.replace(CommonOptions.of(ctx), nats=nats)
    opts = given.server_nats(name="muster-broker", resolve=False)
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


@app.command("store-compact", cls=common(*CONNECTION))
def store_compact(
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
    ctx: typer.Context,
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
    opts = CommonOptions.of(ctx).nats_options(name="muster-store-compact")
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

    run_request(run())


@app.command("config", cls=HelpCommand)
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


@app.command("nats-config", cls=HelpCommand)
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
        nc = await nats_py.connect(**opts.connect_kwargs(reconnects=2))
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


@app.command("jobs-backup", cls=common(*CONNECTION))
def jobs_backup(
    file: Annotated[Path, typer.Argument(help="the backup file to write (JSON lines)")],
    config: BackupConfig = None,
    *,
    ctx: typer.Context,
) -> None:
    """Back up every job record of the job bucket to FILE (the broker may keep running)."""
    from broker.backup import backup

    loaded = _load_config(config)
    opts = CommonOptions.of(ctx).nats_options()
    got = run_request(_bucket_job(opts, lambda nc: backup(nc, loaded.config, file)))
    typer.echo(f"backed up {got.records} job records (bucket sequence {got.last_seq}) to {file}")


@app.command("jobs-restore", cls=common(*CONNECTION))
def jobs_restore(
    file: Annotated[Path, typer.Argument(help="a file written by `muster jobs-backup`")],
    config: BackupConfig = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="overwrite a bucket that already holds records")
    ] = False,
    *,
    ctx: typer.Context,
) -> None:
    """Restore the job bucket from FILE; run it with no broker leading, then start them."""
    from broker.backup import restore

    loaded = _load_config(config)
    got = run_request(
        _bucket_job(
            CommonOptions.of(ctx).nats_options(),
            lambda nc: restore(nc, loaded.config, file, replace=replace),
        )
    )
    typer.echo(f"restored {got.records} job records from {file}")


@app.command(cls=HelpCommand)
def schema() -> None:
    """Print the JSON Schema of the client-facing messages."""
    from schemas.jsonschema import render

    typer.echo(render(), nl=False)
