"""A real broker with a fleet of fake clusters on a real nats-server: the world that end-to-end,
client, CLI and UI tests run against. Each test gets its own subject prefix on the shared
server, unless it asks for the default one on a server of its own (the CLI's case)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats
import pytest_asyncio

from agents.config import AgentConfig, FakeClusterConfig, FakeFlavor, PoolConfig
from agents.fleet import Fleet, start_fake_fleet
from schemas.subjects import Subjects
from tests.broker.conftest import Harness, broker_config

T = TypeVar("T")

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

    async def start(
        self,
        clusters: dict[str, list[FakeFlavor]],
        pools: dict[str, list[PoolConfig]] | None = None,
        **fake: Any,
    ) -> Fleet:
        """`pools`: per cluster, the autoscaled pools its agent declares."""
        h = self.harness
        await h.start_broker()
        configs = [
            AgentConfig(
                cluster=name,
                backend="fake",
                heartbeat_s=0.2,
                subject_prefix=h.prefix,
                pools=(pools or {}).get(name, []),
                fake=FakeClusterConfig(
                    flavors=flavors,
                    **{
                        "time_scale": TIME_SCALE,
                        "start_delay_s": 0.4,
                        "spot_notice_s": 60.0,
                        "seed": 1,
                        **fake,
                    },
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


@contextlib.asynccontextmanager
async def open_world(
    nats_url: str, prefix: str | None = None, **timeouts: Any
) -> AsyncIterator[World]:
    """A world whose broker is not started yet (`World.start` starts it with the fleet)."""
    prefix = prefix or f"e{uuid.uuid4().hex[:10]}"
    nc = await nats.connect(nats_url)
    timeouts = {"lost_after_s": 3.0, **timeouts}
    h = Harness(nats_url, prefix, Subjects(prefix=prefix), broker_config(prefix, **timeouts), nc)
    await h.follow_events()
    w = World(h)
    try:
        yield w
    finally:
        await w.stop()
        await h.stop_broker()
        await nc.close()


@pytest_asyncio.fixture
async def world(nats_url: str) -> AsyncIterator[World]:
    async with open_world(nats_url) as w:
        yield w


class ThreadedWorld:
    """A world on the event loop of a thread of its own, for synchronous callers such as the
    CLI runner (which runs an event loop of its own)."""

    def __init__(
        self, nats_url: str, start: Callable[[World], Awaitable[object]], prefix: str = "muster"
    ) -> None:
        self._cm = open_world(nats_url, prefix)
        self._start = start
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def __enter__(self) -> World:
        self._thread.start()
        world = self.call(self._cm.__aenter__())
        self.call(self._start(world))  # type: ignore[arg-type]
        return world

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self._cm.__aexit__(None, None, None))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
