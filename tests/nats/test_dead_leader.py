"""A dead leader found by its dropped subscription on a real three-server cluster, with an R3
lease bucket: the leader's process on one server, the standby on another. Interest in the
leader's liveness subject crosses the route between them (the standby's probes are answered,
never "no responders", while the leader lives), and `kill -9` of the leader's process hands
over before its lease could expire."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import nats

from broker.service import Broker
from load.common import BrokerProcess
from load.natscluster import NatsCluster
from schemas.config import Replication
from tests.nats.world import cluster_config, connect
from tests.support import wait_for

TTL_S = 8.0  # a probe decides after half of it; the lease expires only after all of it


async def test_kill9_of_the_leader_on_another_server_hands_over_before_expiry(
    nats_cluster: NatsCluster,
) -> None:
    config = cluster_config(f"d{uuid.uuid4().hex[:10]}", Replication(replicas=3), lease_ttl_s=TTL_S)
    first, second = nats_cluster.servers[0], nats_cluster.servers[1]
    leader = BrokerProcess(first.url, config)  # connected to n0 only
    leader.start()
    nc = await connect(nats_cluster)
    standby: Broker | None = None
    running: asyncio.Task[None] | None = None
    try:
        epoch = (await leader.wait_leading(nc, timeout=60))["epoch"]
        standby = Broker(config, await nats.connect(second.url), holder="standby")  # n1 only
        running = asyncio.create_task(standby.run())
        death = standby.lease.death
        assert death is not None
        await wait_for(lambda: death.probes >= 10, 30, what="probes across the route")
        assert death.no_responders == 0, "the leader's interest did not cross the route"
        leader.kill9()
        await asyncio.wait_for(standby.leading.wait(), 2 * TTL_S)
        assert standby.lease.taken_from_dead == 1, "the standby waited out the lease instead"
        assert standby.lease.epoch > epoch
    finally:
        if standby is not None:
            await standby.stop()
            if running is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(running, 15)
            await standby.nc.close()
        leader.cleanup()
        await nc.close()
