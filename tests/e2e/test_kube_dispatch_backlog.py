"""A burst of Dispatches to a kube agent whose API budget is spent: the real broker, the real
agent runtime with `KubeBackend`, a real nats-server and per cluster one stand-in API server
that answers each request 20 ms late.

The agent's client-side budget (client-go's `--kube-api-qps` and `--kube-api-burst`, here 20/s
and 10) makes a burst of 60 single-GPU jobs, three requests each (the namespace's quota, a
Service, a Job), take seconds to carry out, far beyond the broker's first ack wait (1 s) and
its one retry (2 s). A broker that took that for silence cancelled half the burst, sent it to
the other cluster as second attempts and spent the agent's budget on the Cancels' lists. The
agent creates a few attempts at a time and reports each once its Dispatch is done, while the
batch is still being worked through, so the broker waits instead (broker/ackwait.py): each job
starts once, where it was placed, and no copy is sent.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import msgspec

from tests.e2e.conftest import kube_clusters
from tests.e2e.kube_providers import KubeCluster, provider_cluster
from tests.kube.conftest import NS, node
from tests.world import World

JOBS = 60
JOBS_PATH = f"/apis/batch/v1/namespaces/{NS}/jobs"
QUOTAS_PATH = f"/api/v1/namespaces/{NS}/resourcequotas"


async def test_a_burst_to_an_agent_out_of_api_budget_starts_each_job_once(world: World) -> None:
    h = world.harness
    h.config = msgspec.structs.replace(
        h.config,
        timeouts=msgspec.structs.replace(
            h.config.timeouts,
            dispatch_ack_s=1.0,
            dispatch_ack_max_s=10.0,
            dispatch_retries=1,
            start_s=300.0,  # the default: only the ack waits are under test
        ),
    )

    def nodes(name: str) -> list[dict[str, Any]]:
        return [node(f"{name}-n{i}") for i in range(8)]

    def build(name: str, server: Any, api: Any) -> KubeCluster:
        server.latency_s = 0.02  # a real API server is milliseconds away
        return provider_cluster(h, name, server, api, api_qps=20.0, api_burst=10, api_inflight=8)

    async with kube_clusters(world, nodes, build, termination_s=None) as clusters:
        spec = {"replicas": 1, "gpu": 1}
        jobs = [
            {"name": "b", "job_id": f"b-{i}", "gang": [{"name": "w", **spec}], "capacity": "spot"}
            for i in range(JOBS)
        ]
        for j in jobs:
            j["workload"] = {"image": "trainer:1", "command": ["python", "train.py"]}
        replies = await asyncio.gather(*(h.submit(j) for j in jobs))
        assert all(r.accepted for r in replies), replies
        broker = h.broker
        assert broker is not None

        def settled() -> bool:
            return broker.stats["dispatch_acked"] + broker.stats["dispatch_failed"] >= JOBS

        await h.wait_for(settled, 60)
        stats = broker.stats
        assert stats["dispatch_failed"] == 0, stats
        assert stats["ack_retries"] == 0, f"a busy agent was asked again: {stats}"
        assert stats["ack_waits_again"] > 0, f"no ack was slower than its wait: {stats}"
        for j in jobs:
            assert "requeued" not in h.kinds(j["job_id"]), (j["job_id"], h.kinds(j["job_id"]))
        created: Counter[str] = Counter()
        quota_reads = 0
        for c in clusters.values():
            for method, path, _ in c.server.requests:
                if method == "POST" and path == JOBS_PATH:
                    created[c.name] += 1
                quota_reads += (method, path) == ("GET", QUOTAS_PATH)
        assert sum(created.values()) == JOBS, f"a Job created twice or never: {created}"
        # The burst's quota checks shared their reads (agents/kube/quota.py, QuotaReads).
        assert quota_reads <= JOBS // 6, quota_reads
