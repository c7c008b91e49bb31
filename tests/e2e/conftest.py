"""End to end: the real broker shell, the real agent runtime and fake clusters, all on a real
nats-server. Each test gets its own subject prefix on the shared server."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import nats
import pytest_asyncio

from agents.config import AgentConfig, FakeClusterConfig, FakeFlavor
from agents.main import Fleet, start_fake_fleet
from schemas.codec import decode_job_event
from schemas.subjects import Subjects
from tests.broker.conftest import Harness, broker_config

TIME_SCALE = 4.0  # simulated seconds per real second


def flavor(
    name: str, capacity: str = "spot", gpu_type: str = "A100", nodes: int = 2, price: float = 1.0
) -> FakeFlavor:
    return FakeFlavor(
        name=name,
        capacity_type=capacity,  # type: ignore[arg-type]
        gpu_type=gpu_type,
        price_per_gpu_hour=price,
        nodes=nodes,
        gpu_per_node=8,
    )


def sim_job(
    name: str,
    *,
    replicas: int = 1,
    gpu: int = 8,
    steps: int = 400,
    rate: float = 20.0,
    every: int = 20,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "name": name,
        "gang": [{"name": "worker", "replicas": replicas, "gpu": gpu}],
        "checkpoint": {"uri": f"s3://ckpt/{name}"},
        "workload": {
            "simulate": {"total_steps": steps, "steps_per_second": rate, "checkpoint_every": every}
        },
        **extra,
    }


@dataclass
class World:
    harness: Harness
    fleet: Fleet | None = None
    max_live_copies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _watch: asyncio.Task[None] | None = None

    async def start(self, clusters: dict[str, list[FakeFlavor]], **fake: Any) -> Fleet:
        h = self.harness
        await h.start_broker()
        configs = [
            AgentConfig(
                cluster=name,
                backend="fake",
                heartbeat_s=0.2,
                subject_prefix=h.prefix,
                fake=FakeClusterConfig(
                    flavors=flavors,
                    time_scale=TIME_SCALE,
                    start_delay_s=0.4,
                    spot_notice_s=60.0,
                    seed=1,
                    **fake,
                ),
            )
            for name, flavors in clusters.items()
        ]
        self.fleet = await start_fake_fleet(h.nc, configs, h.subjects)
        for name in clusters:
            await h.wait_for(lambda name=name: h.synced(name))  # type: ignore[misc]
        self._watch = asyncio.create_task(self._watch_copies())
        return self.fleet

    async def _watch_copies(self) -> None:
        """Samples every job's live copies; more than one at once would be a bug."""
        for _ in range(100_000):
            assert self.fleet is not None
            counts: dict[str, int] = defaultdict(int)
            for c in self.fleet.clusters.values():
                if c.partitioned:
                    continue  # a partitioned cluster's copy is fenced when it heals
                for job_id, _attempt in c.live_workloads():
                    counts[job_id] += 1
            for job_id, n in counts.items():
                self.max_live_copies[job_id] = max(self.max_live_copies[job_id], n)
            await asyncio.sleep(0.02)

    async def job(self, job_id: str) -> dict[str, Any]:
        reply = await self.harness.api("get", {"job_id": job_id})
        assert reply["ok"], reply
        return reply["result"]  # type: ignore[no-any-return]

    async def step_of(self, job_id: str, attempt: int) -> int:
        assert self.fleet is not None
        for c in self.fleet.clusters.values():
            w = c.workload(job_id, attempt)
            if w is not None and w.step is not None:
                return w.step
        return -1

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.fleet is not None:
            await self.fleet.stop()


@pytest_asyncio.fixture
async def world(nats_url: str) -> AsyncIterator[World]:
    prefix = f"e{uuid.uuid4().hex[:10]}"
    nc = await nats.connect(nats_url)
    h = Harness(
        nats_url, prefix, Subjects(prefix=prefix), broker_config(prefix, lost_after_s=3.0), nc
    )

    async def on_event(msg: Any) -> None:
        event = decode_job_event(msg.data)
        h.events[event.job_id].append(event)
        h._changed.set()

    await nc.subscribe(h.subjects.job_events_all, cb=on_event)
    w = World(h)
    yield w
    await w.stop()
    await h.stop_broker()
    await nc.close()
