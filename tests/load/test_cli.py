"""The load programs as `muster` commands: `muster bench <name>`, `muster sim`, and their
`python -m load.<module>` aliases, which parse and run the same typer command."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from load.cli import Benchmarks
from muster.cli import COMMANDS, LOAD_COMMANDS, app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()

BENCHES = [
    "core",
    "cycle",
    "e2e",
    "flood",
    "flood-cycle",
    "ingest",
    "ingest-core",
    "kube-agent",
    "logs",
    "memory",
    "nats-client",
    "nats-failover",
    "restore",
    "scale",
    "spot",
    "ui",
    "reclaim-storm",
]
# Every program's module, by its `muster` command line.
MODULES = {
    **{("bench", b): f"bench_{b.replace('-', '_')}" for b in BENCHES if b != "reclaim-storm"},
    ("bench", "reclaim-storm"): "reclaim_storm",
    **{(p,): p.replace("-", "_") for p in LOAD_COMMANDS if p != "bench"},
}
DOCUMENTED = ["README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
DOCUMENTED += ["Makefile", ".ci/run"]


def python(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def muster(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return python("-m", "muster", *args, timeout=timeout)


def test_bench_help_lists_every_benchmark() -> None:
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line]
    assert listed == BENCHES
    assert sorted(Benchmarks.lazy_subcommands) == sorted(BENCHES)


def test_top_level_help_lists_the_load_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in LOAD_COMMANDS:
        assert f"\n  {name} " in result.stdout
    programs = [name for name, (where, _) in COMMANDS.items() if where.startswith("load.")]
    assert sorted(programs) == sorted(LOAD_COMMANDS)


@pytest.mark.parametrize("command", sorted(MODULES), ids=" ".join)
def test_each_programs_help_is_its_own(command: tuple[str, ...]) -> None:
    """`muster ... --help` and `python -m load.<module> --help` show the program's options."""
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    alias = python("-m", f"load.{MODULES[command]}", "--help")
    assert alias.returncode == 0, alias.stderr
    assert result.stdout.startswith(f"Usage: muster {' '.join(command)} [OPTIONS]")
    assert alias.stdout.startswith(f"Usage: python -m load.{MODULES[command]} [OPTIONS]")
    # The same options, declared once: only the program name (and the wrapping) differs.
    options = [
        re.sub(r"[\s-]+", " ", out.split("Options:")[1]) for out in (alias.stdout, result.stdout)
    ]
    assert options[0] == options[1]
    assert re.search(r"--(?!help)[a-z]", alias.stdout), "a program with no options of its own"


def documented_command_lines() -> list[tuple[str, str, list[str]]]:
    """Every `python -m load.X ...` and `muster <program> ...` the docs and scripts write."""
    found = []
    stop = r"[^`#\[\n|;:]*(?:\n\s+--[^`#\[\n|;:]*)?"  # a code span may wrap onto the next line
    for name in DOCUMENTED:
        text = (REPO / name).read_text()
        for m in re.finditer(rf"python -m load\.(\w+)({stop})", text):
            found.append((name, m.group(1), shlex.split(m.group(2))))
        for m in re.finditer(rf"\bmuster (bench [a-z][\w-]*|[a-z][\w-]*)({stop})", text):
            command = tuple(m.group(1).split())
            if command in MODULES:
                found.append((name, MODULES[command], shlex.split(m.group(2))))
    return found


def test_the_docs_name_every_program() -> None:
    modules = {module for _, module, _ in documented_command_lines()}
    assert {"bench_e2e", "sim", "vopr", "chaos", "demo", "reclaim_storm"} <= modules


@pytest.mark.parametrize(
    ("doc", "module", "args"),
    documented_command_lines(),
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_every_documented_command_line_parses(doc: str, module: str, args: list[str]) -> None:
    """Parse only: the options are known, typed and in range; nothing runs."""
    program = importlib.import_module(f"load.{module}")
    command = typer.main.get_command(program.app)
    ctx = command.make_context(f"python -m load.{module}", list(args))
    assert ctx.command is command, doc


def test_a_bad_value_is_a_usage_error_naming_the_option() -> None:
    result = runner.invoke(app, ["bench", "flood", "--runs", "0"])
    assert result.exit_code == 2 and "--runs" in result.stderr
    result = runner.invoke(app, ["chaos", "--only", "broker,meteor"])
    assert result.exit_code == 2 and "unknown fault kinds ['meteor']" in result.stderr
    result = runner.invoke(app, ["demo-local", "--steps", "50"])
    assert result.exit_code == 2 and "--steps" in result.stderr
    result = runner.invoke(app, ["sim", "--spot", "sometimes"])
    assert result.exit_code == 2 and "--spot" in result.stderr


def test_vopr_and_its_alias_replay_a_seed_alike() -> None:
    args = ("--seed", "49", "--jobs", "3")
    alias = python("-m", "load.vopr", *args)
    proc = muster("vopr", *args)
    assert proc.returncode == alias.returncode == 0, proc.stderr + alias.stderr
    assert proc.stdout == alias.stdout and proc.stdout.startswith("seed 49: ok, ")


def test_unknown_benchmark_and_bad_option_are_usage_errors() -> None:
    result = runner.invoke(app, ["bench", "warp"])
    assert result.exit_code == 2 and "No such command 'warp'" in result.stderr
    result = runner.invoke(app, ["bench", "core", "--runs", "many"])
    assert result.exit_code == 2 and "Invalid value for '--runs'" in result.stderr


def test_bench_core_and_its_alias_print_the_same_result_shape() -> None:
    args = ("--runs", "1", "--jobs", "200", "--clusters", "2", "--nodes", "4", "--queues", "2")
    results = []
    for cmd in (
        [sys.executable, "-m", "muster", "bench", "core", *args],
        [sys.executable, "-m", "load.bench_core", *args],
    ):
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    for r in results:
        assert r["bench"] == "core" and r["pending_jobs"] == 200 and r["clusters"] == 2
        assert r["fill_admitted_median"] > 0
    assert results[0].keys() == results[1].keys()


def test_sim_small_run(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    proc = muster(
        *("sim", "--jobs", "20", "--policy", "muster", "--workers", "1"),
        *("--max-duration-h", "1", "--drain-h", "12", "--out", "", "--json", str(out)),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "invariant violations" in proc.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert run["policy"] == "muster" and run["summary"]["jobs"] == 20
    assert run["summary"]["violations"] == 0


def test_sim_refuses_an_unknown_policy() -> None:
    proc = muster("sim", "--jobs", "5", "--policy", "lucky", "--out", "")
    assert proc.returncode == 2
    assert "unknown policy ['lucky']" in proc.stderr


def test_client_commands_do_not_import_the_load_programs_or_servers() -> None:
    """`muster status` and a broker's start pay only for what they run."""
    probe = (
        "import sys, muster.cli\n"
        "heavy = [m for m in sys.modules if m.startswith('load') or m in "
        "('agents.fleet', 'broker.service', 'matplotlib')]\n"
        "print(heavy)"
    )
    proc = python("-c", probe)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_python_m_broker_is_the_whole_muster_command() -> None:
    proc = python("-m", "broker", "--help")
    assert proc.returncode == 0, proc.stderr
    for name in ("submit", "broker", "agent", "fleet", "bench", "sim"):
        assert f"\n  {name} " in proc.stdout


def test_listing_the_programs_imports_none_of_them() -> None:
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from muster.cli import app\n"
        "for args in (['--help'], ['bench', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith('load.')))"
    )
    proc = python("-c", probe)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['load.cli']"


@pytest.mark.parametrize("cmd", [("muster",), ("muster", "bench")])
def test_every_summary_in_help_is_whole_on_one_line_at_80_columns(cmd: tuple[str, ...]) -> None:
    """The listing's summaries are cut with "..." (or wrapped) when they do not fit 80 columns."""
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run(
        [sys.executable, "-m", *cmd, "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    listing = proc.stdout.split("Commands:\n")[1].splitlines()
    listed = [line.split()[0] for line in listing if line.strip()]
    # the commands whose docstrings are too long for a listing: each has its own short_help
    long_docs = ("store-compact", "jobs-backup", "jobs-restore", "top", "logs", "agent")
    long_docs += ("fence-watchdog",)
    expected = BENCHES if cmd[1:] == ("bench",) else [*LOAD_COMMANDS, *long_docs, "fleet"]
    assert set(expected) <= set(listed), listing
    for line in listing:
        assert len(line) <= 80, line
        assert not line.startswith("   "), f"a summary wrapped onto a second line: {line!r}"
        assert not line.rstrip().endswith("..."), line
        assert len(line.split()) > 1, f"a command without a summary: {line!r}"
