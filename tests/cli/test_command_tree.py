"""The `muster` command tree: every command, argument and option name as users know them (a
snapshot, `fixtures/commands.json`) and as the docs write them, a `muster --help` that imports
none of the commands' modules, and the shared options reaching a command as one CommonOptions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from muster.cli import COMMANDS, LOAD_COMMANDS, app
from shell.cli import (
    CONNECTION,
    REQUEST,
    CommonOptions,
    LazyCommand,
    Output,
    common,
)
from tests.support import DEPLOY, REPO

SNAPSHOT = Path(__file__).parent / "fixtures" / "commands.json"
runner = CliRunner()


def _params(command: Any) -> list[dict[str, Any]]:
    """What a user types: argument names, option spellings, flags, env vars."""
    found: list[dict[str, Any]] = []
    for p in command.params:
        if p.param_type_name == "argument":
            found.append({"argument": p.name, "required": p.required, "nargs": p.nargs})
            continue
        found.append(
            {
                "option": sorted(p.opts),
                "secondary": sorted(p.secondary_opts),
                "flag": bool(getattr(p, "is_flag", False)),
                "required": p.required,
                "envvar": p.envvar,
                "multiple": p.multiple,
            }
        )
    return sorted(found, key=json.dumps)


def command_tree() -> dict[str, list[dict[str, Any]]]:
    """Every command path of `muster`, each lazily listed command loaded (as running it does)."""
    tree: dict[str, list[dict[str, Any]]] = {}

    def walk(command: Any, ctx: Any, path: str) -> None:
        if isinstance(command, LazyCommand):
            command = command.load()
        tree[path] = _params(command)
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                walk(sub, type(ctx)(sub, parent=ctx, info_name=name), f"{path} {name}")

    root = typer.main.get_command(app)
    walk(root, root.make_context("muster", [], resilient_parsing=True), "muster")
    return tree


def test_every_command_and_option_name_is_unchanged() -> None:
    expected = json.loads(SNAPSHOT.read_text())
    tree = command_tree()
    assert sorted(tree) == sorted(expected), "commands added or gone"
    for path, params in expected.items():
        assert tree[path] == params, f"`{path}`: its arguments or options changed"


def documented_options() -> list[tuple[str, str, str]]:
    """(doc, command, option) for every option the docs write after a `muster <command>`
    (the load programs' command lines are checked in tests/load/test_cli.py)."""
    docs = [REPO / "README.md", DEPLOY / "README.md", *sorted(REPO.glob("docs/*.md"))]
    stop = r"[^`#\[\n|;:]*(?:\n\s+--[^`#\[\n|;:]*)?"  # a code span may wrap onto the next line
    found = []
    for doc in docs:
        for m in re.finditer(rf"\bmuster ([a-z][\w-]*)({stop})", doc.read_text()):
            if m.group(1) in COMMANDS and m.group(1) not in LOAD_COMMANDS:
                for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", m.group(2)):
                    found.append((str(doc.relative_to(REPO)), m.group(1), option))
    return found


def test_every_option_the_docs_write_is_an_option_of_its_command() -> None:
    found = documented_options()
    assert len(found) > 40, found  # the docs name dozens: the finder still finds them
    unknown = []
    for doc, name, option in found:
        command = LazyCommand(name, COMMANDS[name][0], "").load()
        known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        if option not in known:
            unknown.append(f"{doc}: muster {name} {option}")
    assert unknown == []


def test_help_imports_no_command_module() -> None:
    """`muster --help` lists every command from the table of summaries: it imports neither the
    commands' modules nor what they use (NATS, aiohttp, the broker, torch, rich)."""
    probe = (
        "import sys\n"
        "sys.argv = ['muster', '--help']\n"
        "from muster.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        # a deferred module's stand-in (shell.lazyimport) has run none of its code
        "ran = [n for n, m in sys.modules.items() if type(m).__name__ != '_Deferred']\n"
        "print(sorted(ran), file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "\n  status " in proc.stdout and "\n  bench " in proc.stdout
    imported = eval(proc.stderr.strip().splitlines()[-1])  # the probe's own repr of a list
    heavy = ("broker", "agents", "load", "nats", "aiohttp", "torch", "kubernetes_asyncio")
    heavy += ("matplotlib", "rich", "msgspec", "schemas")
    assert [m for m in imported if m.split(".")[0] in heavy] == []
    assert "muster.cli" in imported  # the probe ran the real command


def _options_app() -> typer.Typer:
    """Two commands that print the CommonOptions they were given."""
    probe = typer.Typer()

    @probe.command("request", cls=common(*REQUEST))
    def request(ctx: typer.Context) -> None:
        typer.echo(repr(CommonOptions.of(ctx)))

    @probe.command("connect", cls=common(*CONNECTION))
    def connect(ctx: typer.Context) -> None:
        typer.echo(repr(CommonOptions.of(ctx)))

    return probe


def test_a_command_gets_the_shared_options_it_takes_as_one_value() -> None:
    probe = _options_app()
    args = ["request", "--nats", "nats://h:4222", "--team", "a", "-o", "json", "--timeout", "9"]
    result = runner.invoke(probe, args)
    assert result.exit_code == 0, result.output
    given = CommonOptions(nats="nats://h:4222", team="a", output=Output.json, timeout=9.0)
    assert result.stdout.strip() == repr(given)
    # A command takes only its fields: the others are no options of it, and stay at their
    # defaults even after another command in the same process set them.
    result = runner.invoke(probe, ["connect", "--user", "u"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == repr(CommonOptions(user="u"))
    result = runner.invoke(probe, ["connect", "--output", "json"])
    assert result.exit_code == 2 and "No such option: --output" in result.stderr


def test_a_table_entry_naming_no_command_is_an_error() -> None:
    """A summary whose module holds no command of that name fails when it is loaded (the
    snapshot test loads every command), not by running another one."""
    with pytest.raises(ValueError, match=r"broker\.cli\.app found no command 'stauts'"):
        LazyCommand("stauts", "broker.cli.app", "a misspelt entry").load()
    with pytest.raises(ValueError, match=r"shell\.cli\.err found no command 'err'"):
        LazyCommand("err", "shell.cli.err", "not a command").load()


def test_the_agent_commands_take_the_same_connection_options() -> None:
    """`muster agent` takes its connection through CommonOptions like the broker's commands,
    so it accepts the same flags as `muster status`."""
    tree = command_tree()
    connection = [o for o in tree["muster top"] if o.get("option") != ["--interval"]]
    assert len(connection) == len(CONNECTION)  # top's own option aside, the connection's
    assert all(o in tree["muster agent"] for o in connection)


def test_python_m_agents_main_takes_the_options_of_muster_agent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The module alias the deploy manifests and tests start is the same command: every
    option of `muster agent`, the connection's included, is in its --help."""
    from agents.main import main

    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    options = [o["option"][0] for o in command_tree()["muster agent"] if "option" in o]
    assert options and [o for o in options if o not in shown] == []


def test_python_m_agents_main_runs_the_command_muster_agent_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not a copy registered by hand: the alias runs the very command object the `muster`
    group resolves for `agent`, so an option added there cannot be missing from the alias."""
    from agents.main import main

    group = typer.main.get_command(app)
    with group.make_context("muster", ["agent", "--help"], resilient_parsing=True) as ctx:
        command = group.get_command(ctx, "agent").load()  # type: ignore[union-attr]
    ran: list[tuple[list[str] | None, str]] = []
    monkeypatch.setattr(command, "main", lambda args, prog_name: ran.append((args, prog_name)))
    assert main(["--config", "a.yaml"]) == 0
    assert ran == [(["--config", "a.yaml"], "python -m agents.main")]
