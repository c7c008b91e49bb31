"""The command-line pieces every `muster` command shares (broker, agent, fleet, the client
commands): the shared options as one dataclass, one-line errors, running a server.

Here rather than in broker/ so the agent commands can use them without importing the broker.
Light to import: `muster --help` loads this module, so NATS and the servers are imported only
by the commands that use them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from schemas.natsopts import NatsOptions

T = TypeVar("T")


class _Stderr:
    """stderr through rich, one error = one line; made on first use, so that `muster --help`
    does not import rich."""

    @functools.cached_property
    def console(self) -> Console:
        from rich.console import Console

        return Console(stderr=True, highlight=False, soft_wrap=True)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        self.console.print(*objects, **kwargs)


err = _Stderr()


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


class Output(StrEnum):
    table = "table"
    json = "json"


OutputOpt = Annotated[
    Output, typer.Option("--output", "-o", help="table for people, json for scripts")
]
Timeout = Annotated[float, typer.Option("--timeout", help="seconds to wait for the broker")]


class HelpCommand(typer.core.TyperCommand):
    """Help that reads like other CLIs: `--queue QUEUE` and `FILE`, not `TEXT` and `{FILE}`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.metavar is not None or getattr(param, "is_flag", False):
                continue
            choices = getattr(param.type, "choices", None)
            if choices:
                param.metavar = "[" + "|".join(str(getattr(c, "value", c)) for c in choices) + "]"
            elif param.name:
                param.metavar = param.name.upper()
            if isinstance(param, typer.core.TyperArgument) and param.metavar:
                plain = param.metavar  # `FILE`, `[JOB]` in the usage line: no braces
                shown = plain if param.required else f"[{plain}]"
                param.make_metavar = functools.partial(_argument_metavar, plain, shown)  # type: ignore[method-assign]


def _argument_metavar(plain: str, shown: str, ctx: Any, *, usage: bool = False) -> str:
    """An argument's name as Typer 0.28 asks for it: in the usage line without its braces."""
    return shown if usage else plain


@dataclass(frozen=True)
class CommonOptions:
    """The options the networked commands share (server URL, credentials, TLS, output format,
    timeout), parsed into one value: a command declares the fields it takes with
    `cls=common(...)` and reads them with `CommonOptions.of(ctx)`."""

    nats: NatsUrl = None
    creds: Creds = None
    user: User = None
    password: Password = None
    token: Token = None
    tls_ca: TlsCa = None
    tls_cert: TlsCert = None
    tls_key: TlsKey = None
    inbox_prefix: InboxPrefix = None
    team: TeamOpt = None
    output: OutputOpt = Output.table
    timeout: Timeout = 5.0

    @classmethod
    def of(cls, ctx: typer.Context) -> CommonOptions:
        """The shared options the command of `ctx` was given."""
        found = ctx.meta[_META_KEY]
        assert isinstance(found, cls)
        return found

    def auth(self) -> dict[str, str | None]:
        """The credential, TLS and identity fields, as NatsOptions names them."""
        return {name: getattr(self, name) for name in AUTH}

    def nats_options(self, *, name: str = "muster-cli") -> NatsOptions:
        """NatsOptions from the flags; an unset URL is resolved (see --nats)."""
        from schemas.natsopts import NatsOptions
        from shell.natsio import resolve_nats_url  # nats-py: only once a command connects

        if self.tls_key and not self.tls_cert:
            fail("--tls-key needs --tls-cert (the client certificate it belongs to)")
        for flag, path in (
            ("--creds", self.creds),
            ("--tls-ca", self.tls_ca),
            ("--tls-cert", self.tls_cert),
        ):
            if path and not Path(path).is_file():
                fail(f"{flag} {path}: file not found")
        return NatsOptions(url=self.nats or resolve_nats_url(None), name=name, **self.auth())

    def server_nats(self, *, name: str, resolve: bool) -> NatsOptions | None:
        """A server's NATS options; None (embedded NATS) when no URL is given and `resolve`
        is off."""
        if self.nats is None and not resolve:
            if any(self.auth().values()):
                fail("NATS credentials or TLS options need --nats URL too")
            return None
        return self.nats_options(name=name)


AUTH: tuple[str, ...] = (
    *("creds", "user", "password", "token"),
    *("tls_ca", "tls_cert", "tls_key", "inbox_prefix", "team"),
)
CONNECTION = ("nats", *AUTH)  # what every networked command takes
REQUEST = (*CONNECTION, "output", "timeout")  # and what a request to the broker takes
_META_KEY = "muster.common-options"


@functools.cache
def _common_command() -> Any:
    """CommonOptions as a command of its own: typer declares and converts the options from
    the dataclass's fields, and the command's callback builds the dataclass."""
    app = typer.Typer(add_completion=False, rich_markup_mode=None)
    app.command(cls=HelpCommand)(CommonOptions)
    return typer.main.get_command(app)


class _Common(HelpCommand):
    """A command that also takes `fields` of CommonOptions, listed after its own options.
    `invoke` takes their values out of the parsed parameters and hands them to the command
    as one CommonOptions, in the context's `meta` (click's place for such shared state)."""

    fields: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params += [p for p in _common_command().params if p.name in self.fields]

    def invoke(self, ctx: Any) -> Any:
        # Every field is passed, the ones this command does not take at their defaults: typer's
        # callback would otherwise reuse the values of the last command that took them.
        given = {f.name: f.default for f in dataclasses.fields(CommonOptions)}
        given |= {name: ctx.params.pop(name) for name in self.fields if name in ctx.params}
        ctx.meta[_META_KEY] = _common_command().callback(**given)
        return super().invoke(ctx)


def common(*fields: str) -> type[HelpCommand]:
    """The command class (`app.command(cls=common(...))`) of a command that takes these
    fields of CommonOptions as options."""
    unknown = set(fields) - set(REQUEST)
    assert not unknown, f"not CommonOptions fields: {sorted(unknown)}"
    return type("CommonCommand", (_Common,), {"fields": fields})


# Unknown options and --help go to the lazily loaded command, which parses them.
_PASS_THROUGH: dict[str, Any] = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "help_option_names": [],
}


class LazyCommand(typer.core.TyperCommand):
    """A command listed by name and summary whose module is imported only when it runs or its
    own help is asked for: click's "Further Deferring Imports" (a Command that provides its
    short help and defers the import), so that `muster --help` imports none of them."""

    def __init__(self, name: str, import_path: str, summary: str) -> None:
        super().__init__(
            name=name,
            help=summary,
            short_help=summary,
            context_settings=_PASS_THROUGH,
            add_help_option=False,
        )
        self.import_path = import_path

    def load(self) -> Any:
        """The command itself: `import_path` names a Typer app (its command of this name, or
        its only command) or a click command, as `module.attribute`."""
        return _load(self.import_path, self.name or "")

    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        # The loaded command parses the arguments: the group then invokes `ctx.command`.
        return self.load().make_context(info_name, args, parent=parent, **extra)


def _load(import_path: str, name: str) -> Any:
    module_name, attribute = import_path.rsplit(".", 1)
    found = _command_in(getattr(importlib.import_module(module_name), attribute), name)
    if found is None:
        raise ValueError(f"lazy loading of {import_path} found no command {name!r}")
    return found


@functools.cache
def _command_in(found: Any, name: str) -> Any | None:
    """Command `name` of a Typer app (or the app itself as a program, or a click command),
    None if it has none: one object per app and name, whoever asks."""
    if isinstance(found, typer.Typer):
        found = typer.main.get_command(found)
        if isinstance(found, typer.core.TyperGroup) and name in found.commands:
            return found.commands[name]
        # Otherwise the app is the program itself (a command, or a group with its own callback).
        if isinstance(found, typer.core.TyperGroup) and found.callback is None:
            return None
    return found if hasattr(found, "make_context") else None


class LazyGroup(typer.core.TyperGroup):
    """click's documented lazy group ("Lazily Loading Subcommands",
    https://click.palletsprojects.com/en/stable/complex/): `lazy_subcommands` maps a command
    name to where it is defined, and `get_command` imports it. Kept in the table's order (the
    listing's order), not sorted; each command's summary is in the table so that the group's
    `--help` imports none of them."""

    lazy_subcommands: dict[str, tuple[str, str]] = {}  # name -> (module.attribute, summary)

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *self.lazy_subcommands]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in self.lazy_subcommands:
            import_path, summary = self.lazy_subcommands[cmd_name]
            return LazyCommand(cmd_name, import_path, summary)
        return super().get_command(ctx, cmd_name)


def fail(message: str) -> NoReturn:
    """One clear line on stderr, exit status 1."""
    from rich.text import Text

    err.print(Text(f"error: {message}", style="red"))
    raise typer.Exit(1)


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


def tidy_help(app: typer.Typer) -> None:
    """Give every command of `app` registered so far the HelpCommand help."""
    for info in app.registered_commands:
        if info.cls in (None, typer.core.TyperCommand):
            info.cls = HelpCommand


def run_alias(app: typer.Typer, name: str, argv: Sequence[str] | None, prog: str) -> int:
    """Run command `name` of `app` as its own program and return its exit status: what a
    `python -m` alias of a `muster` command calls. It is the object the `muster` group loads
    for that command, so the alias takes exactly the options `muster NAME` takes."""
    command = _command_in(app, name)
    if command is None:
        raise ValueError(f"{prog}: its app has no command {name!r}")
    try:
        command.main(args=None if argv is None else list(argv), prog_name=prog)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
