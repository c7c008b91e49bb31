"""Waiting for clusters to show as healthy in `muster clusters`, across broker restarts."""

from __future__ import annotations

import asyncio
import time

from broker.client import MusterClient
from schemas.natsopts import NatsOptions


async def wait_clusters(url: str, names: set[str], timeout: float = 60) -> None:
    """Each try on a fresh connection, so a NATS that restarts meanwhile does not matter."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with MusterClient(NatsOptions(url=url, name="wait-clusters")) as client:
                live = {c.name for c in await client.clusters(timeout=2) if c.health == "healthy"}
            if names <= live:
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{sorted(names)} not healthy in `muster clusters` within {timeout}s")
