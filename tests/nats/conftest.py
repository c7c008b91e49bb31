"""A three-server NATS cluster per test (load/natscluster.py), and the one-server world."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from load.natscluster import NatsCluster
from tests.world import world  # noqa: F401  (fixture re-export: a broker and fake fleet)


@pytest_asyncio.fixture
async def nats_cluster() -> AsyncIterator[NatsCluster]:
    cluster = NatsCluster()
    cluster.start_all()
    try:
        await cluster.ready()
        yield cluster
    finally:
        cluster.cleanup()
