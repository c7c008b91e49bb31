"""One logging setup for every Muster process (broker, agents, fleet, CLI), kept apart from the
packages that use it so the broker does not import agent code to configure its logs."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO, cast

import msgspec
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
        [structlog.processors.dict_tracebacks, render_json]
        if fmt == "json"
        else [structlog.dev.ConsoleRenderer(colors=tty)]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            UtcStamp(),
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


EventDict = MutableMapping[str, Any]


class UtcStamp:
    """structlog's `TimeStamper(fmt="%Y-%m-%dT%H:%M:%S.%fZ", utc=True)`, with the text of
    the current second made once a second rather than by `strftime` on every line: at `info`
    the broker writes a few lines per job, and a line now costs half what it did with the
    stock stamper and renderer (`python -m load.bench_logs`; docs/benchmarks.md, "The
    broker's lines at `info`")."""

    __slots__ = ("_second", "_text")

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def __call__(self, _logger: object, _name: str, event_dict: EventDict) -> EventDict:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        event_dict["timestamp"] = f"{self._text}.{int((now - second) * 1e6):06d}Z"
        return event_dict


def _fallback(value: object) -> object:
    """What structlog's JSONRenderer writes for a value JSON has no type for."""
    own = getattr(value, "__structlog__", None)
    return own() if callable(own) else repr(value)


_encoder = msgspec.json.Encoder(enc_hook=_fallback)


def render_json(_logger: object, _name: str, event_dict: EventDict) -> str:
    """One JSON object per line, encoded by msgspec rather than `json.dumps` (load.bench_logs).
    A value JSON has no type for is written as its `repr`, as structlog's JSONRenderer does
    (msgspec Structs, dataclasses, sets and datetimes are written as JSON values, a key that
    is not a string as its `repr`). An event msgspec refuses whole (a cycle) keeps its
    event, level and time, with the rest as one `repr`: a log call never raises."""
    try:
        return _encoder.encode(event_dict).decode()
    except Exception:
        kept = {k: str(event_dict.get(k)) for k in ("event", "level", "timestamp")}
        return json.dumps({**kept, "unencodable": repr(event_dict)})
