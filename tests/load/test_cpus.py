"""Where a benchmark's processes run (load/cpus.py)."""

from __future__ import annotations

import os

import pytest

from load import cpus


def test_a_core_of_the_brokers_own_is_refused_on_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one core there is nothing to give the broker alone: said, not pinned anyway."""
    monkeypatch.setattr(cpus, "cores", lambda: [3])
    with pytest.raises(RuntimeError, match="needs two cores or more"):
        cpus.split()


def test_the_broker_gets_the_first_core_and_the_others_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpus, "cores", lambda: [0, 1, 2])
    assert cpus.split() == ({0}, {1, 2})


def test_pinning_a_gone_process_says_so() -> None:
    gone = os.getpid() + 10_000_000  # above any pid the kernel hands out (pid_max <= 4M)
    with pytest.raises(RuntimeError, match="is gone"):
        cpus.pin(gone, {0})
