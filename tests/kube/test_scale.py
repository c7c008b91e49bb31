"""The kube agent against a 5,000-node, 150,000-pod cluster on the stand-in API server.

One run of `load/bench_kube_agent.py` (the stand-in and the agent each in a process of their
own, so the agent's peak RSS is its own): initial list, resync, 410 re-list, then a checkpoint
request to a 1,000-pod gang. Bounds, not speeds: how long one step of the agent's code held
its event loop before yielding (the user CPU time of one callback, so neither a loaded
machine's waits nor the kernel's time reclaiming memory for it count), that no loop iteration
froze (the CPU of every callback ready in it, the kernel's included), its peak RSS, that every
pod was accounted, and that the fan-out went out concurrently.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

NODES = 5000
PODS = 150_000
GANG = 1000
# The loop is never held longer than this by one step of the agent's code (each yields after
# ~5 ms of work, client.Pacer; one page's decode cannot be cut: ~8 ms here, docs/benchmarks.md).
# User CPU: one step of the re-list once took 117 ms of CPU in CI beside another test worker
# (8 ms alone, and beside two CPU burners); its kernel time, faulting in and reclaiming memory
# under the neighbour's pressure, is the machine's, not the agent's.
MAX_STEP_CPU_MS = 100.0
# Nor is one iteration of the loop, every callback ready in it together, anywhere near a
# freeze (which was seconds long). Several steps can be ready at once (both re-lists, their
# responses' readers): 15-25 ms here, 105 ms once in CI beside another test worker.
MAX_STALL_CPU_MS = 500.0
MAX_RSS_MIB = 400.0  # 150,000 pods as a few integers each; the decoded objects are transient


@pytest.mark.timeout(300)
def test_agent_at_5000_nodes_and_150000_pods(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "load.bench_kube_agent",
            "--nodes",
            str(NODES),
            "--pods",
            str(PODS),
            "--gang",
            str(GANG),
            "--runs",
            "1",
            "--steady-s",
            "0",
            "--no-baseline",
            "--json",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the stand-in and the agent child go with it on a timeout
    )
    try:
        _, stderr = proc.communicate(timeout=280)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    assert run["nodes_seen"] == NODES
    assert run["pods_seen"] == PODS  # every pod's usage accounted, after the re-list too
    for phase in ("list", "resync", "relist", "rest"):
        assert run[f"step_user_cpu_{phase}_ms"] < MAX_STEP_CPU_MS, (phase, run)
        assert run[f"stall_cpu_{phase}_ms"] < MAX_STALL_CPU_MS, (phase, run)
    assert run["peak_rss_mib"] < MAX_RSS_MIB, run
    # One merged PATCH per pod of the gang, many in flight at once, none refused.
    assert run["fanout_patches"] == GANG
    assert run["fanout_peak_inflight"] > 1
    assert run["fanout_throttled"] == 0
