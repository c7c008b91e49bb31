"""The agent's part of the `muster` command line: `muster agent` (one cluster, or every cluster
of a fleet file) and `muster fleet` (many fake clusters in one process)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agents.config import load_fleet_config
from shell.cli import (
    CONNECTION,
    CommonOptions,
    LogFormatFlag,
    LogLevel,
    LogLevelOpt,
    common,
    fail,
    serve,
    tidy_help,
)
from shell.logs import configure_logging

app = typer.Typer(rich_markup_mode=None)

MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        min=1,
        max=65535,
        help="serve Prometheus /metrics on --metrics-addr:PORT (off by default)",
        show_default=False,
    ),
]
MetricsAddr = Annotated[
    str,
    typer.Option(
        "--metrics-addr", help="address for /metrics; put anything wider than 127.0.0.1 behind auth"
    ),
]


@app.command(
    cls=common(*CONNECTION), short_help="Run one cluster agent, or each agent of a fleet file."
)
def agent(
    config: Annotated[
        Path,
        typer.Option(
            "--config", "-c", help="agent YAML (`cluster:`), or a fleet YAML (`clusters:`)"
        ),
    ],
    log_level: LogLevelOpt = LogLevel.info,
    log_format: LogFormatFlag = None,
    metrics_port: MetricsPort = None,
    metrics_addr: MetricsAddr = "127.0.0.1",
    *,
    ctx: typer.Context,
) -> None:
    """Run one cluster agent (backend kube, fake or local), or each agent of a fleet file,
    over one NATS connection until SIGTERM or Ctrl-C."""
    configure_logging(log_level.value, log_format.value if log_format else None)
    try:
        configs = load_fleet_config(config).clusters
    except (ValueError, OSError) as exc:
        fail(str(exc))
    name = f"muster-agent-{configs[0].cluster}" if len(configs) == 1 else "muster-fleet"
    opts = CommonOptions.of(ctx).server_nats(name=name, resolve=True)
    assert opts is not None
    from agents.fleet import run_fleet, until_signal  # the agent's imports, only when it runs

    serve(until_signal(run_fleet(configs, opts, metrics_port, metrics_addr, pace_gc=True)))


@app.command("fence-watchdog", short_help="Delete workloads whose fence lapsed (a hung agent's).")
def fence_watchdog(
    namespace: Annotated[str, typer.Option("--namespace", help="the workload namespace")] = (
        "muster-workloads"
    ),
    period: Annotated[
        float, typer.Option("--period", help="seconds between sweeps", min=0.1, max=600)
    ] = 5.0,
    skew: Annotated[
        float,
        typer.Option("--skew", help="seconds a fence must be past before deleting", min=0, max=600),
    ] = 2.0,
    in_cluster: Annotated[
        bool, typer.Option("--in-cluster", help="use the pod's service account")
    ] = False,
    kubeconfig: Annotated[
        str | None, typer.Option("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    ] = None,
    log_level: LogLevelOpt = LogLevel.info,
    log_format: LogFormatFlag = None,
    metrics_port: MetricsPort = None,
    metrics_addr: MetricsAddr = "127.0.0.1",
) -> None:
    """Delete Muster's workload objects whose fence lapsed (a hung agent no longer extends it),
    so the cluster ends their pods without the agent. Runs beside a kube agent whose config
    sets `fence_watchdog: true`."""
    configure_logging(log_level.value, log_format.value if log_format else None)
    import msgspec  # the watchdog's imports, only when it runs

    from agents.fleet import until_signal
    from agents.kube.watchdog import WatchdogConfig
    from agents.kube.watchdog import serve as serve_watchdog

    raw = {"namespace": namespace, "period_s": period, "skew_s": skew}
    try:
        config = msgspec.convert(raw, WatchdogConfig)
    except msgspec.ValidationError as exc:
        fail(f"fence-watchdog: {exc} (--namespace must be a DNS label)")
    coro = serve_watchdog(
        config,
        in_cluster=in_cluster,
        kubeconfig=kubeconfig,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
    )
    serve(until_signal(coro))


# The same command under the name the demos and load tests use for many fake clusters.
app.command(
    "fleet",
    cls=common(*CONNECTION),
    help="Run many (fake) cluster agents in one process, for demos and load tests.",
    short_help="Run many (fake) cluster agents in one process.",
)(agent)


tidy_help(app)
