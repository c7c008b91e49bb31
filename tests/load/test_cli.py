"""The load programs as `muster` commands: `muster bench <name>`, `muster sim`, and their
`python -m load.<module>` aliases, which run the same function."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from load.cli import bench, programs
from muster.cli import LOAD_COMMANDS, app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()

BENCHES = ["core", "cycle", "e2e", "ingest", "scale", "spot", "ui", "reclaim-storm"]


def muster(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_help_lists_every_benchmark() -> None:
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line]
    assert listed == BENCHES
    assert sorted(c.name for c in bench.registered_commands) == sorted(BENCHES)


def test_top_level_help_lists_the_load_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in LOAD_COMMANDS:
        assert f"\n  {name} " in result.stdout
    assert sorted(c.name or "" for c in programs.registered_commands) == sorted(
        set(LOAD_COMMANDS) - {"bench"}
    )


@pytest.mark.parametrize("name", BENCHES)
def test_bench_help_is_the_programs_own(name: str) -> None:
    """`--help` reaches the benchmark's own parser."""
    result = runner.invoke(app, ["bench", name, "--help"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("usage: ")
    assert "--runs" in result.stdout or "--jobs" in result.stdout


def test_unknown_benchmark_and_bad_option_are_usage_errors() -> None:
    result = runner.invoke(app, ["bench", "warp"])
    assert result.exit_code == 2 and "No such command 'warp'" in result.stderr
    result = runner.invoke(app, ["bench", "core", "--runs", "many"])
    assert result.exit_code == 2 and "--runs: invalid int value: 'many'" in result.stderr


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
        "('agents.main', 'broker.service', 'matplotlib')]\n"
        "print(heavy)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_python_m_broker_is_the_whole_muster_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "broker", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("submit", "broker", "agent", "fleet", "bench", "sim"):
        assert f"\n  {name} " in proc.stdout
