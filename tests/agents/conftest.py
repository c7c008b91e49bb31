"""Fixtures for agent tests: a fake cluster + runtime on the shared nats-server, and a
BrokerWire that watches and commands it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest_asyncio
from nats.aio.client import Client

from agents.config import FakeClusterConfig, FakeFlavor
from agents.fake.cluster import FakeCluster
from agents.runtime import AgentRuntime
from schemas.agent import ProvisionPool
from tests.agents.helpers import BrokerWire, unique


@dataclass
class Agent:
    cluster: FakeCluster
    runtime: AgentRuntime
    wire: BrokerWire

    @property
    def name(self) -> str:
        return self.cluster.cluster


def fast_config(**overrides: object) -> FakeClusterConfig:
    """Two flavors of 4 nodes x 8 GPUs, quick starts and ticks (short tests)."""
    base: dict[str, object] = {
        "flavors": [
            FakeFlavor(name="spot-a100", capacity_type="spot", nodes=4),
            FakeFlavor(name="od-a100", capacity_type="on-demand", nodes=4),
        ],
        "start_delay_s": 0.05,
        "spot_notice_s": 0.3,
        "tick_s": 0.005,
        "seed": 7,
    }
    base.update(overrides)
    return FakeClusterConfig(**base)  # type: ignore[arg-type]


MakeAgent = Callable[..., Awaitable[Agent]]


@pytest_asyncio.fixture
async def make_agent(nc: Client) -> AsyncIterator[MakeAgent]:
    made: list[Agent] = []

    async def make(
        config: FakeClusterConfig | None = None,
        *,
        heartbeat_s: float = 0.2,
        batch_max: int = 1000,
        batch_interval_s: float = 0.005,
        pools: dict[str, ProvisionPool] | None = None,
    ) -> Agent:
        name = unique("c")
        cluster = FakeCluster(name, config or fast_config())
        wire = await BrokerWire(nc, name).start()
        rt = AgentRuntime(
            cluster,
            nc,
            heartbeat_s=heartbeat_s,
            batch_max=batch_max,
            batch_interval_s=batch_interval_s,
            pools=pools,
        )
        cluster.on_outage = rt.set_partitioned
        await rt.start()
        agent = Agent(cluster, rt, wire)
        made.append(agent)
        return agent

    yield make
    for a in made:
        await a.runtime.stop()
        await a.wire.stop()
