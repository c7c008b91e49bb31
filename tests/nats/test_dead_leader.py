"""A dead leader found by its dropped subscription on a real three-server cluster, with an R3
lease bucket: the leader's process on one server, the standby on another. Interest in the
leader's liveness subject crosses the route between them (the standby's probes are answered,
never "no responders", while the leader lives), and `kill -9` of the leader's process hands
over before its lease could expire."""

from __future__ import annotations

import uuid

from load.common import BrokerProcess
from load.natscluster import NatsCluster
from schemas.config import Replication
from tests.handover import in_process, kill9_hands_over, probed
from tests.nats.world import cluster_config, connect

TTL_S = 8.0  # a probe decides after half of it; the lease expires only after all of it


async def test_kill9_of_the_leader_on_another_server_hands_over_before_expiry(
    nats_cluster: NatsCluster,
) -> None:
    config = cluster_config(f"d{uuid.uuid4().hex[:10]}", Replication(replicas=3), lease_ttl_s=TTL_S)
    first, second = nats_cluster.servers[0], nats_cluster.servers[1]
    leader = BrokerProcess(first.url, config)  # connected to n0 only
    leader.start()
    nc = await connect(nats_cluster)
    try:
        epoch = (await leader.wait_leading(nc, timeout=60))["epoch"]
        async with in_process(config, second.url, "standby") as standby:  # n1 only
            await probed(standby, 10, 30)  # answered across the route
            await kill9_hands_over(leader, standby, epoch, TTL_S)
    finally:
        leader.cleanup()
        await nc.close()
