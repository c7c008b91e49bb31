"""The operator's live commands (`muster top`, `muster logs`) and the dashboard options of
`muster broker`, kept apart from the request/reply commands in broker.cli."""

from __future__ import annotations

from typing import Annotated

import typer

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


def register_live(app: typer.Typer) -> None:
    """Add the live commands to the `muster` CLI."""
