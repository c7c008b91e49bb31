"""The repository stands alone: a copy of its tracked files, with nothing beside it, imports and
replays its traces; nothing tracked points outside the repository; and a copy without the
traces says what is missing instead of raising a bare FileNotFoundError."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs inside the copy: every trace-reading path, and a tiny simulation.
PROBE = """
import sys
from pathlib import Path

import load.traces as traces
from agents.config import load_fleet_config
from load.fleetbench import gang_sizes
from load.sim import Sim
from load.simconfig import SimConfig
from load.traces import default_traces_dir, load_bamboo, load_philly

here = Path.cwd().resolve()
assert Path(traces.__file__).resolve().is_relative_to(here), traces.__file__
assert default_traces_dir().is_relative_to(here)
print("philly", len(load_philly()))
print("p3", len(load_bamboo(default_traces_dir() / "bamboo-p3.csv")))
print("g4dn", len(load_bamboo(default_traces_dir() / "bamboo-g4dn.csv")))
print("sizes", gang_sizes()[1])
fleet = load_fleet_config("examples/fleet-fake.yaml")
(bamboo,) = [c for c in fleet.clusters if c.fake and c.fake.trace]
trace = Path(bamboo.fake.trace.path)
assert trace.is_relative_to(here) and trace.is_file(), trace
res = Sim(SimConfig(jobs=15, max_duration_s=1800.0, drain_s=86_400.0), "muster").run()
print("sim", sum(1 for r in res.records.values() if r.state == "succeeded"))
"""


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (git ls-files names the tracked files)")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    )
    return [p for p in out.stdout.decode().split("\0") if p]


def _copy(dest: Path, skip: tuple[str, ...] = ()) -> Path:
    repo = dest / "muster"
    for rel in _tracked():
        if rel.startswith(skip) or not (ROOT / rel).is_file():
            continue  # skipped, or deleted in the work tree but not yet in git
        target = repo / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    return repo


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip


def test_a_copy_with_nothing_beside_it_reads_its_traces(tmp_path: Path) -> None:
    repo = _copy(tmp_path)
    assert not (repo.parent / "shared").exists()
    done = _run(repo, "-c", PROBE)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["philly"] == "82247"
    assert int(lines["p3"]) == 344 and int(lines["g4dn"]) > 0  # 177 adds + 167 removes
    assert lines["sizes"] == "philly.csv"
    assert int(lines["sim"]) == 15


def test_nothing_tracked_points_outside_the_repository() -> None:
    outside = re.compile("|".join([r"\.\./" + "shared", r"/work" + "/", "shared" + "/seeds"]))
    offenders = []
    for rel in _tracked():
        path = ROOT / rel
        if path.suffix in (".png", ".csv") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{rel}: {m.group(0)}" for m in outside.finditer(text)]
    assert offenders == []


def test_a_copy_without_traces_says_what_is_missing(tmp_path: Path) -> None:
    repo = _copy(tmp_path, skip=("data/",))
    done = _run(repo, "-m", "load.sim", "--jobs", "10", "--out", "")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: trace philly.csv not found at ")
    assert "data/traces/README.md" in line
    probe = "from load.traces import load_philly\nload_philly()"
    done = _run(repo, "-c", probe)
    assert "MissingTraceError: trace philly.csv not found" in done.stderr
    assert "FileNotFoundError" not in done.stderr
