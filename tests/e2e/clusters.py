"""Waiting for clusters to show as healthy in `muster clusters`, across broker restarts."""

from __future__ import annotations

from broker.client import MusterClient
from schemas.natsopts import NatsOptions
from tests.support import wait_for


async def wait_clusters(url: str, names: set[str], timeout: float = 60) -> None:
    """Each try on a fresh connection, so a NATS that restarts meanwhile does not matter."""

    async def healthy() -> bool:
        try:
            async with MusterClient(NatsOptions(url=url, name="wait-clusters")) as client:
                live = {c.name for c in await client.clusters(timeout=2) if c.health == "healthy"}
        except Exception:
            return False
        return names <= live

    what = f"{sorted(names)} healthy in `muster clusters`"
    await wait_for(healthy, timeout, what=what, interval=0.2)  # each try is a new connection
