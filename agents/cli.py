"""The agent's part of the `muster` command line: `muster agent` (one cluster, or every cluster
of a fleet file) and `muster fleet` (many fake clusters in one process)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agents.config import load_fleet_config
from shell.cli import (
    LogFormatFlag,
    LogLevel,
    LogLevelOpt,
    NatsAuth,
    NatsUrl,
    fail,
    serve,
    server_nats,
    tidy_help,
    with_nats_auth,
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


@app.command()
@with_nats_auth
def agent(
    config: Annotated[
        Path,
        typer.Option(
            "--config", "-c", help="agent YAML (`cluster:`), or a fleet YAML (`clusters:`)"
        ),
    ],
    nats: NatsUrl = None,
    log_level: LogLevelOpt = LogLevel.info,
    log_format: LogFormatFlag = None,
    metrics_port: MetricsPort = None,
    metrics_addr: MetricsAddr = "127.0.0.1",
    *,
    auth: NatsAuth,
) -> None:
    """Run one cluster agent (backend kube, fake or local), or each agent of a fleet file,
    over one NATS connection until SIGTERM or Ctrl-C."""
    configure_logging(log_level.value, log_format.value if log_format else None)
    try:
        configs = load_fleet_config(config).clusters
    except (ValueError, OSError) as exc:
        fail(str(exc))
    name = f"muster-agent-{configs[0].cluster}" if len(configs) == 1 else "muster-fleet"
    opts = server_nats(nats, auth, name=name, resolve=True)
    assert opts is not None
    from agents.main import run_fleet, until_signal  # the agent's imports, only when it runs

    serve(until_signal(run_fleet(configs, opts, metrics_port, metrics_addr)))


# The same command under the name the demos and load tests use for many fake clusters.
app.command(
    "fleet", help="Run many (fake) cluster agents in one process, for demos and load tests."
)(agent)


tidy_help(app)
