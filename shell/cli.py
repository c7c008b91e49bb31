"""The command-line pieces every `muster` process command shares (broker, agent, fleet, the
client commands): NATS credential and TLS options, one-line errors, running a server.

Here rather than in broker/ so the agent commands can use them without importing the broker.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NamedTuple, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from schemas.natsopts import NatsOptions
from shell.natsio import resolve_nats_url

T = TypeVar("T")

err = Console(stderr=True, highlight=False, soft_wrap=True)  # one error = one line


class EventLoopOpt(StrEnum):
    asyncio = "asyncio"
    uvloop = "uvloop"


EventLoopFlag = Annotated[
    EventLoopOpt,
    typer.Option(
        "--event-loop",
        envvar="MUSTER_EVENT_LOOP",
        help="asyncio, or uvloop (installed by `pip install muster[uvloop]`)",
    ),
]


def loop_factory(loop: EventLoopOpt) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a server runs on: None for asyncio's own. uvloop is an optional extra,
    so asking for it without it installed is a one-line error that says how to get it."""
    if loop is EventLoopOpt.asyncio:
        return None
    try:
        import uvloop
    except ImportError:
        fail(
            "--event-loop uvloop: uvloop is not installed; install it with "
            "`pip install 'muster[uvloop]'`, or run on asyncio (--event-loop asyncio)"
        )
    return uvloop.new_event_loop


class LogFormatOpt(StrEnum):
    json = "json"
    console = "console"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


NatsUrl = Annotated[
    str | None,
    typer.Option(
        "--nats",
        help="NATS URL(s), comma-separated (default: $MUSTER_NATS, then <state dir>/nats.url, "
        "then nats://127.0.0.1:4222)",
        show_default=False,
    ),
]
Creds = Annotated[str | None, typer.Option("--creds", help="NATS .creds file (JWT + nkey)")]
User = Annotated[str | None, typer.Option("--user", help="NATS user")]
Password = Annotated[
    str | None,
    typer.Option("--password", envvar="MUSTER_NATS_PASSWORD", help="NATS password"),
]
Token = Annotated[
    str | None, typer.Option("--token", envvar="MUSTER_NATS_TOKEN", help="NATS auth token")
]
TlsCa = Annotated[str | None, typer.Option("--tls-ca", help="CA bundle to verify NATS")]
TlsCert = Annotated[str | None, typer.Option("--tls-cert", help="client certificate (mTLS)")]
TlsKey = Annotated[str | None, typer.Option("--tls-key", help="client key (mTLS)")]
InboxPrefix = Annotated[
    str | None,
    typer.Option(
        "--inbox-prefix",
        envvar="MUSTER_NATS_INBOX_PREFIX",
        help="private reply prefix, _INBOX_<user> under `muster nats-config` permissions",
    ),
]
TeamOpt = Annotated[
    str | None,
    typer.Option("--team", envvar="MUSTER_TEAM", help="act as this team (its API and events)"),
]
LogLevelOpt = Annotated[LogLevel, typer.Option("--log-level", help="log verbosity")]
LogFormatFlag = Annotated[
    LogFormatOpt | None,
    typer.Option(
        "--log-format",
        help="json (one object per line) or console; default: console on a terminal, else json",
        show_default=False,
    ),
]


class NatsAuth(NamedTuple):
    """The NATS credential and TLS flags every networked command takes."""

    creds: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox_prefix: str | None = None
    team: str | None = None


_AUTH_PARAMS = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
    for name, annotation in zip(
        NatsAuth._fields,
        (Creds, User, Password, Token, TlsCa, TlsCert, TlsKey, InboxPrefix, TeamOpt),
        strict=True,
    )
]


def with_nats_auth(fn: Callable[..., None]) -> Callable[..., None]:
    """Give a command the credential, TLS and inbox options, handed to it as one `auth` argument
    (typer has no option groups; this keeps each command's signature about its own flags)."""
    sig = inspect.signature(fn, eval_str=True)
    own = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in sig.parameters.values()
        if p.name != "auth"
    ]
    at = next((i + 1 for i, p in enumerate(own) if p.name == "nats"), len(own))
    params = own[:at] + _AUTH_PARAMS + own[at:]  # listed in --help right after --nats

    @functools.wraps(fn)
    def command(**kwargs: Any) -> None:
        auth = NatsAuth(*(kwargs.pop(name) for name in NatsAuth._fields))
        fn(auth=auth, **kwargs)

    del command.__wrapped__  # typer must see the signature below, not fn's
    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return command


def fail(message: str) -> NoReturn:
    """One clear line on stderr, exit status 1."""
    err.print(Text(f"error: {message}", style="red"))
    raise typer.Exit(1)


def nats_options(url: str | None, auth: NatsAuth, *, name: str = "muster-cli") -> NatsOptions:
    """NatsOptions from the CLI flags; an unset URL is resolved (see --nats)."""
    if auth.tls_key and not auth.tls_cert:
        fail("--tls-key needs --tls-cert (the client certificate it belongs to)")
    for flag, path in (
        ("--creds", auth.creds),
        ("--tls-ca", auth.tls_ca),
        ("--tls-cert", auth.tls_cert),
    ):
        if path and not Path(path).is_file():
            fail(f"{flag} {path}: file not found")
    return NatsOptions(url=url or resolve_nats_url(None), name=name, **auth._asdict())


def server_nats(url: str | None, auth: NatsAuth, *, name: str, resolve: bool) -> NatsOptions | None:
    """A server's NATS options; None (embedded NATS) when no URL is given and `resolve` is off."""
    if url is None and not resolve:
        if any(auth):
            fail("NATS credentials or TLS options need --nats URL too")
        return None
    return nats_options(url, auth, name=name)


async def as_coroutine(aw: Awaitable[T]) -> T:
    return await aw


def serve(
    coro: Awaitable[None],
    user_errors: tuple[type[Exception], ...] = (ValueError,),
    loop: EventLoopOpt = EventLoopOpt.asyncio,
) -> None:
    """Run a server until it ends; whatever stops it is one line on stderr, never a traceback
    (`--log-level debug` logs the traceback for a bug report). `user_errors` are the bad
    configs and settings whose message says what to fix."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(as_coroutine(coro))
    except KeyboardInterrupt:
        pass
    except user_errors as exc:
        fail(str(exc))
    except Exception as exc:
        import structlog

        structlog.get_logger("muster").debug("server stopped", exc_info=True)
        fail(f"{type(exc).__name__}: {exc} (run with --log-level debug for the traceback)")


class HelpCommand(typer.core.TyperCommand):
    """Help that reads like other CLIs: `--queue QUEUE` and `FILE`, not `<str>` and `{file}`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.metavar is not None or getattr(param, "is_flag", False):
                continue
            desc = getattr(param, "type_descriptor", None)
            choices = getattr(desc, "choices", None) if getattr(desc, "is_choice", False) else None
            if choices:
                param.metavar = "[" + "|".join(str(getattr(c, "value", c)) for c in choices) + "]"
            elif param.name:
                param.metavar = param.name.upper()
            if param.param_type_name == "argument":  # `FILE`, `[JOB]`: the name says enough
                shown = param.metavar if param.required else f"[{param.metavar}]"
                param.display_type_rich = lambda ctx: None  # type: ignore[attr-defined]
                param._usage_display_name = lambda shown=shown: shown  # type: ignore[attr-defined]


def tidy_help(app: typer.Typer) -> None:
    """Give every command of `app` registered so far the HelpCommand help."""
    for info in app.registered_commands:
        if info.cls in (None, typer.core.TyperCommand):
            info.cls = HelpCommand


def invoke(command: Callable[..., Any], argv: Sequence[str] | None, prog: str) -> int:
    """Run one typer command function as its own program and return its exit status: what a
    `python -m` alias of a `muster` command calls."""
    app = typer.Typer(
        add_completion=False, pretty_exceptions_show_locals=False, rich_markup_mode=None
    )
    app.command()(command)
    try:
        app(args=None if argv is None else list(argv), prog_name=prog)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
