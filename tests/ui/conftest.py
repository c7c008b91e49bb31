"""The dashboard served by a real broker on the shared real nats-server, with fake clusters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest_asyncio

from agents.config import FakeFlavor
from agents.fake.cluster import AttemptRecord
from broker.ui.server import Dashboard
from tests.broker.conftest import harness  # noqa: F401  (fixture re-export)
from tests.world import World, flavor, world  # noqa: F401  (fixture re-export)


@dataclass
class Live:
    world: World
    dashboard: Dashboard
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.dashboard.url

    def reclaim(self, job_id: str, lead_s: float = 120.0) -> AttemptRecord:
        """A spot notice on the node of the job's current attempt; returns that attempt."""
        fleet = self.world.fleet
        assert fleet is not None
        current = fleet.history(job_id)[-1]
        fleet[current.cluster].spot_notice(current.nodes[0], lead_s=lead_s)
        return current

    async def get(self, path: str) -> tuple[int, object]:
        async with self.http.get(self.url + path) as resp:
            return resp.status, await resp.json()


async def open_dashboard(on: World, **fleet: list[FakeFlavor]) -> Dashboard:
    """Two clusters with one spot node each by default, so a reclaimed job moves."""
    await on.start(
        fleet or {"a": [flavor("spot", "spot", nodes=1)], "b": [flavor("spot", "spot", nodes=1)]}
    )
    assert on.harness.broker is not None
    dashboard = Dashboard(on.harness.broker)
    await dashboard.start("127.0.0.1", 0)  # its event hub is subscribed when this returns
    return dashboard


@pytest_asyncio.fixture
async def live(world: World) -> AsyncIterator[Live]:  # noqa: F811  (the fixture above)
    dashboard = await open_dashboard(
        world,
        a=[flavor("spot", "spot", nodes=1)],
        b=[flavor("spot", "spot", nodes=1, price=1.1)],
    )
    async with aiohttp.ClientSession() as http:
        yield Live(world, dashboard, http)
    await dashboard.stop()
