"""The local backend driven directly: real processes in a temporary work directory."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio

from agents.config import LocalClusterConfig, LocalFlavor, LocalNode
from agents.local.backend import LocalBackend
from schemas.agent import AgentEvent, CheckpointRef, Dispatch, PodSetAssignment, WorkloadStatus
from schemas.job import JobSpec

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


def local_config(
    workdir: Path, *, nodes: int = 2, gpu: int = 2, capacity: str = "spot", **flavor: Any
) -> LocalClusterConfig:
    fl = LocalFlavor(
        name="slots",
        capacity_type=capacity,  # type: ignore[arg-type]
        nodes=[LocalNode(gpu=gpu, cpu="4", memory="8Gi") for _ in range(nodes)],
        **flavor,
    )
    return LocalClusterConfig(workdir=str(workdir), flavors=[fl], poll_s=0.05, cancel_grace_s=1.0)


def dispatch(
    job_id: str,
    command: list[str],
    nodes: list[str],
    *,
    attempt: int = 1,
    env: dict[str, str] | None = None,
    checkpoint_uri: str = "",
    resume: CheckpointRef | None = None,
    fence_after_s: float = 0.0,
) -> Dispatch:
    spec: dict[str, Any] = {
        "name": job_id,
        "gang": [{"name": "worker", "replicas": len(nodes), "gpu": 1}],
        "workload": {"command": command, "env": env or {}},
    }
    if checkpoint_uri:
        spec["checkpoint"] = {"uri": checkpoint_uri}
    import msgspec

    return Dispatch(
        job_id=job_id,
        attempt=attempt,
        epoch=1,
        flavor="slots",
        assignment=[PodSetAssignment(podset="worker", nodes=nodes)],
        spec=msgspec.convert(spec, JobSpec),
        resume_from=resume,
        fence_after_s=fence_after_s,
    )


class Recorder:
    """Collects what the backend emits; waits for conditions, never for fixed times."""

    def __init__(self) -> None:
        self.events: list[AgentEvent] = []
        self._changed = asyncio.Event()

    def __call__(self, ev: AgentEvent) -> None:
        self.events.append(ev)
        self._changed.set()

    def statuses(self, job_id: str) -> list[WorkloadStatus]:
        return [e for e in self.events if isinstance(e, WorkloadStatus) and e.job_id == job_id]

    def phases(self, job_id: str) -> list[str]:
        return [s.phase for s in self.statuses(job_id)]

    async def wait(self, pred: Callable[[], bool], timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                self._changed.clear()
                try:
                    async with asyncio.timeout(0.05):
                        await self._changed.wait()
                except TimeoutError:
                    pass

    async def ended(self, job_id: str, timeout: float = 20.0) -> WorkloadStatus:
        ends = ("succeeded", "failed", "evicted")
        await self.wait(lambda: any(p in ends for p in self.phases(job_id)), timeout)
        return next(s for s in self.statuses(job_id) if s.phase in ends)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group whose members are all zombies still answers; look for a live member.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        rest = text[text.rindex(")") + 2 :].split()
        if int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            return True
    return False


async def wait_dead(pgids: list[int], timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while any(group_alive(p) for p in pgids):
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture
async def started(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """`await started(config)` gives a started backend and its recorder; all are stopped and
    every replica they started is killed at the end."""
    backends: list[LocalBackend] = []

    async def make(
        config: LocalClusterConfig, cluster: str = "lab"
    ) -> tuple[LocalBackend, Recorder]:
        rec = Recorder()
        b = LocalBackend(cluster, config)
        await b.start(rec)
        backends.append(b)
        return b, rec

    yield make
    for b in backends:
        for job_id, attempt in b.live_workloads():
            await b.cancel(job_id, attempt, "test over")
        await b.stop()
