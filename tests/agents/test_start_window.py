"""The fake backend behind a restarting agent, over a real nats-server: a revision of a running
attempt sent while the new agent still reads its cluster is a resize there too (the runtime,
and so its start-up order, is the same for every backend; tests/kube/test_start_window.py has
the kube stand-in)."""

from __future__ import annotations

import msgspec
from nats.aio.client import Client

from agents.fake import FakeCluster
from agents.runtime import AgentRuntime
from schemas.job import Simulation
from tests.agents.conftest import fast_config
from tests.agents.helpers import (
    BrokerWire,
    HeldFirstSnapshot,
    dispatch,
    sent_while_starting,
    unique,
)

SLOW = Simulation(total_steps=100_000, steps_per_second=20.0, checkpoint_every=10)


async def test_a_resize_sent_while_the_restarted_agent_reads_the_fake_cluster_is_taken(
    nc: Client,
) -> None:
    cluster = FakeCluster(unique("c"), fast_config())
    first = AgentRuntime(cluster, nc, heartbeat_s=0.2)
    wire = await BrokerWire(nc, cluster.cluster).start()
    try:
        await first.start()
        nodes = cluster.nodes_of("spot-a100")[:2]
        running = dispatch("job-e", nodes, gpu=1, sim=SLOW)
        assert (await wire.send(running)).ok
        await wire.wait_status("job-e", 1, "running")
        await first.stop()  # the cluster and its workload live on
        shrunk = dispatch("job-e", nodes[:1], gpu=1, sim=SLOW)
        revised = msgspec.structs.replace(shrunk, revision=1)
        restarted = AgentRuntime(cluster, nc, heartbeat_s=0.2)
        ack = await sent_while_starting(restarted, HeldFirstSnapshot(cluster), revised)
        assert ack.ok, ack.error
        (wl,) = [w for w in cluster.view().workloads if w.job_id == "job-e"]
        assert (wl.attempt, wl.total_replicas, wl.nodes) == (1, 1, nodes[:1])
        assert cluster.counters["resized"] == 1
    finally:
        await first.stop()
        await wire.stop()
