"""`muster drain` end to end through the kube backend: the real broker, the real agent runtime
with `KubeBackend` on stand-in API servers, a real nats-server. A drained node's pods are
evicted through the Eviction API, the attempt ends as an infrastructure loss, and the job
resumes on the other cluster from its latest checkpoint."""

from __future__ import annotations

from broker.client import MusterClient
from broker.nodeops import node_op
from schemas.natsopts import NatsOptions
from tests.e2e.kube_providers import KubeCluster, kube_world
from tests.world import World

__all__ = ["kube_world"]  # the fixture, used by name


async def test_drain_evicts_and_the_job_resumes_elsewhere_from_its_checkpoint(
    kube_world: tuple[World, dict[str, KubeCluster]],
) -> None:
    world, clusters = kube_world
    h = world.harness
    reply = await h.submit(
        {
            "name": "ddp",
            "job_id": "ddp-1",
            "gang": [{"name": "worker", "replicas": 2, "gpu": 4}],
            "capacity": "spot",
            "checkpoint": {"uri": "s3://ckpt"},
            "workload": {"image": "trainer:1", "command": ["torchrun", "train.py"]},
        }
    )
    assert reply.accepted, reply
    first = await h.wait_event("ddp-1", "running")
    home = clusters[first.cluster or ""]
    away = clusters["west" if home.name == "east" else "east"]
    name = "ddp-1-a1-worker"
    home.write_checkpoint(name, 120)
    await h.wait_event("ddp-1", "checkpointed")
    node_name = home.pods_of(name)[0]["spec"]["nodeName"]

    async with MusterClient(NatsOptions(url=h.url), subjects=h.subjects) as ops:
        done = await node_op(ops, home.name, "drain", node_name, reason="kernel upgrade")
    assert done.nodes == [node_name] and done.attempts == ["ddp-1/1"]
    assert (home.server.get(f"/api/v1/nodes/{node_name}") or {})["spec"]["unschedulable"]
    evicted = [p for p in home.pods_of(name) if p["spec"]["nodeName"] == node_name]
    assert evicted and all(p["metadata"].get("deletionTimestamp") for p in evicted)
    assert any(
        c.get("reason") == "EvictionByEvictionAPI"
        for p in evicted
        for c in p["status"].get("conditions", [])
    )
    home.server.finish_terminating()  # the kubelet ends the evicted pods

    admitted = await h.wait_event("ddp-1", "admitted", count=2)
    assert admitted.resume_from_step == 120
    second = await h.wait_event("ddp-1", "running", count=2)
    assert second.attempt == 2 and "failed" not in h.kinds("ddp-1")
    where = clusters[second.cluster or ""]
    nodes = {p["spec"]["nodeName"] for p in where.pods_of("ddp-1-a2-worker")}
    assert nodes and (where is away or node_name not in nodes)  # never the cordoned node
