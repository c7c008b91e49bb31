"""deploy/Dockerfile replayed without a Docker daemon: its COPY lines copied into an empty build
context, its RUN line's install into a fresh venv, and the entrypoint run from there with the
source tree off the path. A package the Dockerfile forgets to copy, or a file the wheel does
not carry (package data), fails here as it would fail in the image. Not replayed: the base
image itself (`python:3.11-slim`, its OS packages), the runtime dependencies (taken from this
venv, not resolved again), `USER 65532` and the image's file permissions."""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support import DEPLOY, REPO

DOCKERFILE = DEPLOY / "Dockerfile"
STEP_TIMEOUT_S = 120  # a pip step; the whole replay takes about 20 s on a quiet machine


def copy_context(dockerfile: str, root: Path, workdir: Path) -> list[str]:
    """Do what the Dockerfile's COPY lines do (sources are globs under the build context, a
    destination ending in `/` is a directory); returns the RUN lines."""
    runs = []
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if line.startswith("RUN "):
            runs.append(line[4:])
        if not line.startswith("COPY "):
            continue
        *sources, dest = shlex.split(line[5:])
        assert not any(s.startswith("--") for s in sources), f"COPY flags not replayed: {line}"
        target = workdir / dest
        for pattern in sources:
            for match in sorted(glob.glob(pattern, root_dir=root)):
                src = root / match
                out = target / src.name if dest.endswith("/") else target
                out.parent.mkdir(parents=True, exist_ok=True)
                if src.is_dir():
                    shutil.copytree(
                        src, out, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True
                    )
                else:
                    shutil.copy2(src, out)
    return runs


def pip_flags(runs: list[str]) -> list[str]:
    """The options of the RUN line's `pip install .`, which the replay uses too."""
    for run in runs:
        words = shlex.split(run.split("&&")[0])
        if words[:2] == ["pip", "install"]:
            assert words[-1] == ".", f"the image installs something else than the context: {run}"
            return [w for w in words[2:-1] if w.startswith("--")]
    raise AssertionError("deploy/Dockerfile has no `RUN pip install ... .` line")


def pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
    )


def replay(dockerfile: str, tmp: Path) -> Path:
    """Build the image's Python environment; returns its `muster` entrypoint."""
    src = tmp / "src"
    src.mkdir()
    flags = pip_flags(copy_context(dockerfile, REPO, src))
    # The build backend pyproject.toml names (and what it needs), fetched once; nothing else
    # is downloaded.
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    backend = tmp / "backend"
    got = pip("download", "--dest", backend, *requires)
    if got.returncode != 0:
        pytest.skip(f"the build backend {requires} cannot be fetched: {got.stderr[-300:]}")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    python = venv / "bin" / "python"
    for step in (
        ("--python", python, "install", "--no-index", "--find-links", backend, *requires),
        ("--python", python, "install", *flags, "--no-deps", "--no-build-isolation", src),
    ):
        done = pip(*step)
        assert done.returncode == 0, f"pip {step[2:]} failed:\n{done.stdout}\n{done.stderr}"
    # The runtime dependencies come from this venv, after the image's own packages.
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "site-packages" / "test-deps.pth").write_text("\n".join(deps) + "\n")
    return venv / "bin" / "muster"


def run(exe: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env
    )


def test_the_image_replayed_from_its_dockerfile_runs_its_entrypoint(tmp_path: Path) -> None:
    muster = replay(DOCKERFILE.read_text(), tmp_path)
    for args in ([], ["broker"], ["agent"]):
        done = run(muster, *args, "--help", cwd=tmp_path)
        command = " ".join(["muster", *args, "--help"])
        assert done.returncode == 0, f"{command}:\n{done.stderr[-2000:]}"
        assert "usage" in done.stdout.lower(), done.stdout
    # What ran is the installed copy, not the source tree.
    python = muster.parent / "python"
    probe = (
        "import json, sys, importlib; "
        "print(json.dumps([sys.path, [importlib.import_module(m).__file__ for m in sys.argv[1:]]]))"
    )
    packages = ["muster", "broker", "agents", "schemas", "shell", "kinds", "load"]
    where = run(python, "-c", probe, *packages, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    path, files = json.loads(where.stdout)
    assert str(REPO) not in path and "" not in path[1:], path
    for name, file in zip(packages, files, strict=True):
        assert Path(file).is_relative_to(tmp_path / "venv"), (name, file)
    # Package data the broker and the manifests need is in the wheel.
    for data in ("kinds/crds", "broker/ui/static"):
        installed = list((tmp_path / "venv").glob(f"lib/python3*/site-packages/{data}/*"))
        assert installed, f"{data} is not in the installed image"
