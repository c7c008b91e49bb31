"""One logging setup for every Muster process (broker, agents, fleet, CLI), kept apart from the
packages that use it so the broker does not import agent code to configure its logs."""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog


def configure_logging(level: str = "info") -> None:
    """structlog and stdlib logging at `level`, to stderr, with UTC millisecond timestamps
    (restarts and failovers are read from logs to the millisecond). Per-command logs are
    debug, so load stays cheap."""
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt="%Y-%m-%dT%H:%M:%S.%fZ", utc=True),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
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
