"""The benchmarks start brokers and commands with bytecode cached, as an installed Muster
has it, whatever the shell sets, and leave the environment as they found it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from load.common import bytecode_cached


def test_a_process_started_inside_caches_its_bytecode_in_a_directory_removed_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    module = tmp_path / "cached_module_probe.py"
    module.write_text("VALUE = 1\n")
    with bytecode_cached(True):
        cache = Path(os.environ["PYTHONPYCACHEPREFIX"])
        subprocess.run(
            [sys.executable, "-c", "import cached_module_probe"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
            check=True,
        )
        assert list(cache.rglob("cached_module_probe*.pyc")), "no bytecode was written"
    assert not cache.exists()
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "PYTHONPYCACHEPREFIX" not in os.environ


def test_bytecode_not_cached_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--compile-each-start` (bench_scale): every start compiles, as the shell says."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    with bytecode_cached(False):
        assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
        assert "PYTHONPYCACHEPREFIX" not in os.environ
