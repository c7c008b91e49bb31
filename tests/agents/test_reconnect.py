"""Reconnect and reconciliation against a nats-server that is stopped and restarted."""

from __future__ import annotations

import asyncio
import contextlib

import nats

from agents.fake.cluster import FakeCluster
from agents.runtime import AgentRuntime
from broker.embedded import EmbeddedNats
from schemas.agent import ClusterSnapshot
from schemas.job import Simulation
from tests.agents.conftest import fast_config
from tests.agents.helpers import BrokerWire, dispatch, unique
from tests.support import wait_for


async def test_server_restart_resends_snapshot_with_workloads(fresh_nats: EmbeddedNats) -> None:
    opts = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.1, "connect_timeout": 2}
    broker_nc = await nats.connect(fresh_nats.url, **opts)
    holder: dict[str, AgentRuntime] = {}
    probe = unique("probe")
    heard = asyncio.Event()

    async def on_probe(msg: object) -> None:
        heard.set()

    # Resubscribed with the stand-in broker's other subscriptions after a reconnect.
    await broker_nc.subscribe(probe, cb=on_probe)

    async def delivered() -> bool:
        heard.clear()
        await agent_nc.publish(probe, b"")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):
                await heard.wait()
        return heard.is_set()

    async def reconnected() -> None:
        # Test-only: wait until what the agent publishes reaches the stand-in broker again
        # (it resubscribes, and a restarted server drops interest for a while after start),
        # so the snapshot cannot be missed. A real broker would see the seq gap and resync.
        await wait_for(delivered, 10, what="a probe from the agent reaches the broker")
        await holder["rt"].on_reconnected()

    agent_nc = await nats.connect(fresh_nats.url, reconnected_cb=reconnected, **opts)
    name = unique("r")
    cluster = FakeCluster(name, fast_config())
    rt = holder["rt"] = AgentRuntime(cluster, agent_nc, heartbeat_s=0.1)
    wire = await BrokerWire(broker_nc, name).start()
    await rt.start()
    try:
        sim = Simulation(total_steps=100_000, steps_per_second=50.0)
        assert (await wire.send(dispatch("job-rc", cluster.nodes[:2], sim=sim))).ok
        await wire.wait_status("job-rc", 1, "running")
        instance = rt.instance

        await asyncio.to_thread(fresh_nats.stop_sync)
        await wait_for(lambda: not agent_nc.is_connected and not broker_nc.is_connected)
        n = len(wire.batches)
        await asyncio.to_thread(fresh_nats.start_sync)

        def snap_with_workload() -> ClusterSnapshot | None:
            for s in wire.events(ClusterSnapshot, since=n):
                if s.workloads:
                    return s
            return None

        snap = await wire.wait_for(snap_with_workload, timeout=10)
        (wl,) = snap.workloads
        assert (wl.job_id, wl.attempt, wl.phase) == ("job-rc", 1, "running")
        assert rt.instance == instance  # same instance: seq continues, no restart
        assert wire.batches[-1].seq > wire.batches[n - 1].seq
        # Commands work again after the reconnect.
        ack = await wire.send(dispatch("job-rc", cluster.nodes[:2], sim=sim), timeout=3)
        assert ack.ok
    finally:
        await rt.stop()
        await wire.stop()
        await agent_nc.close()
        await broker_nc.close()
