"""A real agent process (`python -m agents.main`, fake backend) for the broker's tests that
need its gate and fences as shipped, not a scripted stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path


def fake_agent_yaml(cluster: str, prefix: str) -> str:
    """One on-demand node of 8 A100s, heartbeats every 0.2 s, workloads starting in 0.2 s."""
    return f"""
cluster: {cluster}
backend: fake
heartbeat_s: 0.2
subject_prefix: {prefix}
fake:
  time_scale: 1.0
  start_delay_s: 0.2
  seed: 1
  flavors:
    - name: od
      capacity_type: on-demand
      gpu_type: A100
      nodes: 1
      gpu_per_node: 8
"""


@contextlib.asynccontextmanager
async def fake_agent(
    cluster: str, prefix: str, url: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The agent process of `cluster`, stopped (continued first, should a test have frozen
    it) when the block ends."""
    with tempfile.TemporaryDirectory(prefix="muster-agent-") as tmp:
        conf = Path(tmp) / "agent.yaml"
        conf.write_text(fake_agent_yaml(cluster, prefix))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agents.main",
            "--config",
            str(conf),
            "--nats",
            url,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            yield proc
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 10)
