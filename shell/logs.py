"""One logging setup for every Muster process (broker, agents, fleet, CLI), kept apart from the
packages that use it so the broker does not import agent code to configure its logs."""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO, cast

import structlog

LogFormat = Literal["json", "console"]


def configure_logging(level: str = "info", fmt: LogFormat | None = None) -> None:
    """structlog and stdlib logging at `level`, to stderr, with UTC millisecond timestamps
    (restarts and failovers are read from logs to the millisecond). Per-command logs are
    debug, so load stays cheap. `fmt`: one JSON object per line (for log collectors; the
    default when stderr is not a terminal) or aligned console lines (the default on a
    terminal)."""
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    tty = sys.stderr.isatty()
    if fmt is None:
        fmt = "console" if tty else "json"
    renderer: list[Any] = (
        [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
        if fmt == "json"
        else [structlog.dev.ConsoleRenderer(colors=tty)]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt="%Y-%m-%dT%H:%M:%S.%fZ", utc=True),
            *renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _Stderr())),
        cache_logger_on_first_use=True,
    )


class _Stderr:
    """Whatever sys.stderr is at the time of writing (test runners swap and close it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()
