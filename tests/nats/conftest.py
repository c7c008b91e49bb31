"""A three-server NATS cluster per test (tests/nats/cluster.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.nats.cluster import NatsCluster


@pytest_asyncio.fixture
async def nats_cluster() -> AsyncIterator[NatsCluster]:
    cluster = NatsCluster()
    cluster.start_all()
    try:
        await cluster.ready()
        yield cluster
    finally:
        cluster.cleanup()
