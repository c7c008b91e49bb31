"""Real processes in a temporary work directory: the local backend driven directly
(`started`), and a real broker with two `local` agents on the real nats-server (`lab`)."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest_asyncio

from agents.config import AgentConfig, LocalClusterConfig, LocalFlavor, LocalNode
from agents.fleet import Fleet, start_fleet
from agents.local.backend import LocalBackend
from agents.runtime import AgentRuntime
from schemas.agent import AgentEvent, CheckpointRef, Dispatch, PodSetAssignment, WorkloadStatus
from schemas.job import JobSpec
from schemas.subjects import Subjects
from tests.broker.conftest import Harness, broker_config
from tests.support import wait_for

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
        await wait_for(pred, timeout, changed=self._changed)

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
    await wait_for(lambda: not any(group_alive(p) for p in pgids), timeout, what="groups gone")


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


def local_agent(name: str, workdir: Path, prefix: str, price: float, gpu: int) -> AgentConfig:
    """One spot slot group of `gpu` GPUs."""
    return AgentConfig(
        cluster=name,
        backend="local",
        heartbeat_s=0.2,
        subject_prefix=prefix,
        local=LocalClusterConfig(
            workdir=str(workdir),
            flavors=[
                LocalFlavor(
                    name="spot",
                    capacity_type="spot",
                    price_per_gpu_hour=price,
                    nodes=[LocalNode(gpu=gpu)],
                    grace_s=2.0,
                )
            ],
            poll_s=0.05,
        ),
    )


@dataclass
class Lab:
    harness: Harness
    tmp: Path
    fleet: Fleet | None = None
    configs: dict[str, AgentConfig] = field(default_factory=dict)
    extra: list[AgentRuntime] = field(default_factory=list)

    async def start(self, gpu: int = 1) -> Fleet:
        """Agents `a` (cheaper) and `b`, one spot slot group each."""
        h = self.harness
        await h.start_broker()
        self.configs = {
            "a": local_agent("a", self.tmp / "agents", h.prefix, 1.0, gpu),
            "b": local_agent("b", self.tmp / "agents", h.prefix, 1.5, gpu),
        }
        self.fleet = await start_fleet(h.nc, list(self.configs.values()), h.subjects)
        for name in self.configs:
            await h.wait_for(lambda name=name: h.synced(name))  # type: ignore[misc]
        return self.fleet

    def backend(self, cluster: str) -> LocalBackend:
        assert self.fleet is not None
        return self.fleet.local[cluster]

    async def restart_agent(self, cluster: str) -> LocalBackend:
        """A new agent process for `cluster`: a new backend over the same work directory."""
        cfg = self.configs[cluster]
        backend = LocalBackend(cluster, cfg.local)
        rt = AgentRuntime(backend, self.harness.nc, subjects=self.harness.subjects, heartbeat_s=0.2)
        await rt.start()
        self.extra.append(rt)
        return backend

    async def broker_has_checkpoint(self, job_id: str, step: int, timeout: float = 15) -> None:
        def known() -> bool:
            machine = self.harness.broker.machine if self.harness.broker else None
            record = machine.jobs.get(job_id) if machine else None
            latest = record.latest_checkpoint if record else None
            return latest is not None and latest.step >= step

        await self.harness.wait_for(known, timeout=timeout)

    async def log_has(self, cluster: str, job_id: str, attempt: int, text: str) -> None:
        path = self.tmp / "agents" / cluster / job_id / f"attempt-{attempt}" / "rank-0.log"
        await wait_for(lambda: path.exists() and text in path.read_text(), 30, what=text)

    def log(self, cluster: str, job_id: str, attempt: int) -> str:
        path = self.tmp / "agents" / cluster / job_id / f"attempt-{attempt}" / "rank-0.log"
        return path.read_text()

    async def stop(self) -> None:
        for rt in self.extra:
            await rt.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        for d in (self.tmp / "agents").glob("*"):  # leave no replica behind
            b = LocalBackend(d.name, self.configs[d.name].local)
            await b.start(lambda _event: None)  # adopts what the agents left
            for job_id, attempt in b.live_workloads():
                await b.cancel(job_id, attempt, "test over")
            await b.stop()


@pytest_asyncio.fixture
async def lab(nats_url: str, tmp_path: Path) -> AsyncIterator[Lab]:
    prefix = f"l{uuid.uuid4().hex[:10]}"
    nc = await nats.connect(nats_url)
    config = broker_config(prefix, lost_after_s=4.0, fence_lead_s=2.0, checkpoint_grace_s=10.0)
    h = Harness(nats_url, prefix, Subjects(prefix=prefix), config, nc)
    await h.follow_events()
    world = Lab(h, tmp_path)
    yield world
    await world.stop()
    await h.stop_broker()
    await nc.close()
