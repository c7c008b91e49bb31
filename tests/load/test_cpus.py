"""Where a benchmark's processes run (load/cpus.py)."""

from __future__ import annotations

import os
import time

import pytest

from load import cpus
from load.common import proc_cpu_s


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


def _state(pid: int) -> str | None:
    """The kernel's state letter of `pid` (R running, Z exited and not yet reaped), or None
    once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_burners_keep_cores_busy_while_the_block_runs_and_are_gone_after_it() -> None:
    with cpus.burners(2) as pids:
        assert len(pids) == 2
        deadline = time.monotonic() + 10
        while not all(proc_cpu_s(p) >= 0.05 for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(proc_cpu_s(p) >= 0.05 for p in pids), "each burner spends CPU"
        assert all(_state(p) in ("R", "S") for p in pids)
    assert [_state(p) for p in pids] == [None, None]


def test_a_burner_stops_by_itself_after_its_time() -> None:
    """A benchmark killed before its block ends leaves nothing spinning past `max_s`."""
    with cpus.burners(1, max_s=0.3) as pids:
        deadline = time.monotonic() + 10
        while _state(pids[0]) not in ("Z", None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(pids[0]) in ("Z", None)
