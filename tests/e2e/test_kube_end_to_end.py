"""End to end through the kube backend: the real broker, the real agent runtime with
`KubeBackend`, a real nats-server, and per cluster one stand-in Kubernetes API server
(`tests/kube/fake_apiserver.py`; no real API server can be installed here). The test plays the
parts Kubernetes would: the Job controller and kubelet run the pods it finds, the workload writes
checkpoint annotations, the cloud taints a spot node. Everything between is Muster's own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest_asyncio
from kubernetes_asyncio.client import ApiClient, Configuration

from agents.kube.backend import KubeBackend
from agents.runtime import AgentRuntime
from tests.broker.conftest import Harness
from tests.e2e.conftest import World
from tests.kube.conftest import NODES, NS, PODS, make_config, node, pod
from tests.kube.fake_apiserver import FakeApiServer

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
SPOT_TAINT = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}


@dataclass
class KubeCluster:
    """One cluster: its stand-in API server, its agent, and a loop playing kubelet."""

    name: str
    server: FakeApiServer
    api: ApiClient
    runtime: AgentRuntime
    kubelet: asyncio.Task[None] | None = None
    jobs_seen: set[str] = field(default_factory=set)

    def jobs(self) -> list[dict[str, Any]]:
        return self.server.items("batch/v1", "jobs")

    def pods_of(self, job_name: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.server.items("v1", "pods")
            if p["metadata"]["name"].startswith(job_name + "-")
        ]

    async def run_kubelet(self) -> None:
        """For every Job Muster creates: its pods, Running, on the nodes the broker assigned."""
        for _ in range(20_000):  # bounded: 20,000 x 10 ms
            for job in self.jobs():
                name = job["metadata"]["name"]
                if name in self.jobs_seen:
                    continue
                self.jobs_seen.add(name)
                tmpl = job["spec"]["template"]
                terms = tmpl["spec"]["affinity"]["nodeAffinity"][
                    "requiredDuringSchedulingIgnoredDuringExecution"
                ]["nodeSelectorTerms"]
                nodes = terms[0]["matchFields"][0]["values"]
                for i in range(job["spec"]["completions"]):
                    p = pod(f"{name}-{i}-x", nodes[i % len(nodes)], namespace=NS, gpu=4)
                    p["metadata"]["labels"] = copy.deepcopy(tmpl["metadata"]["labels"])
                    p["metadata"]["annotations"] = copy.deepcopy(tmpl["metadata"]["annotations"])
                    p["spec"]["containers"][0]["env"] = tmpl["spec"]["containers"][0]["env"]
                    self.server.put(PODS, p)
            await asyncio.sleep(0.01)

    def write_checkpoint(self, job_name: str, step: int) -> None:
        """What the checkpoint SDK does in a pod: annotate itself with the newest checkpoint."""
        for p in self.pods_of(job_name):
            p = copy.deepcopy(p)
            p["metadata"]["annotations"]["muster.dev/checkpoint"] = json.dumps(
                {"step": step, "uri": f"s3://ckpt/{job_name}/{step}"}
            )
            self.server.put(PODS, p)

    def complete(self, job_name: str) -> None:
        """What the Job controller does when every index succeeded."""
        job = copy.deepcopy(self.server.get(f"{JOBS}/{job_name}"))
        assert job is not None
        job["status"] = {
            "succeeded": job["spec"]["completions"],
            "conditions": [{"type": "Complete", "status": "True", "reason": "Completed"}],
        }
        self.server.put(JOBS, job)


@pytest_asyncio.fixture
async def kube_world(world: World) -> AsyncIterator[tuple[World, dict[str, KubeCluster]]]:
    h: Harness = world.harness
    await h.start_broker()
    clusters: dict[str, KubeCluster] = {}
    try:
        for name in ("east", "west"):
            server = FakeApiServer()
            await server.start()
            for i in range(2):
                server.put(NODES, node(f"{name}-n{i}"))  # Karpenter spot, 8 GPUs, pool a100
            api = ApiClient(configuration=Configuration(host=server.url))
            backend = KubeBackend(name, make_config(), api_client=api)
            runtime = AgentRuntime(backend, h.nc, subjects=h.subjects, heartbeat_s=0.2)
            cluster = KubeCluster(name, server, api, runtime)
            clusters[name] = cluster
            await runtime.start()
            cluster.kubelet = asyncio.create_task(cluster.run_kubelet())
            await h.wait_for(lambda name=name: h.synced(name))  # type: ignore[misc]
        yield world, clusters
    finally:
        for c in clusters.values():
            if c.kubelet is not None:
                c.kubelet.cancel()
                with contextlib.suppress(BaseException):
                    await c.kubelet
            await c.runtime.stop()
            await c.api.close()
            await c.server.close()


async def test_spot_reclaim_moves_the_gang_to_another_cluster_from_its_checkpoint(
    kube_world: tuple[World, dict[str, KubeCluster]],
) -> None:
    world, clusters = kube_world
    h = world.harness
    most_live = 0

    async def count_live_copies() -> None:
        """Samples the Jobs of ddp-1 across both API servers: never more than one at a time."""
        nonlocal most_live
        for _ in range(10_000):
            live = sum(
                1
                for c in clusters.values()
                for j in c.jobs()
                if j["metadata"]["name"].startswith("ddp-1-a")
            )
            most_live = max(most_live, live)
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(count_live_copies())
    reply = await h.submit(
        {
            "name": "ddp",
            "job_id": "ddp-1",
            "gang": [{"name": "worker", "replicas": 2, "gpu": 4}],
            "capacity": "spot",
            "checkpoint": {"uri": "s3://ckpt"},  # the pods write below it
            "workload": {"image": "trainer:1", "command": ["torchrun", "train.py"]},
        }
    )
    assert reply.accepted, reply
    first = await h.wait_event("ddp-1", "running")
    home, away = (
        clusters[first.cluster or ""],
        clusters["west" if first.cluster == "east" else "east"],
    )
    (job,) = home.jobs()
    name = job["metadata"]["name"]
    assert name == "ddp-1-a1-worker" and job["spec"]["completions"] == 2

    # The workload checkpoints at step 120; the broker records it.
    home.write_checkpoint(name, 120)
    await h.wait_event("ddp-1", "checkpointed")

    # The cloud reclaims the node under replica 0: a spot-interruption taint appears.
    node_name = home.pods_of(name)[0]["spec"]["nodeName"]
    tainted = copy.deepcopy(home.server.get(f"{NODES}/{node_name}"))
    assert tainted is not None
    tainted["spec"]["taints"] = [SPOT_TAINT]
    home.server.put(NODES, tainted)
    await h.wait_event("ddp-1", "preempting")

    # The agent asks the pods to checkpoint now (annotation); the workload answers at step 150.
    def asked() -> bool:
        return all(
            "muster.dev/checkpoint-request" in p["metadata"]["annotations"]
            for p in home.pods_of(name)
        )

    await h.wait_for(asked, 5)  # fails with "condition not met" if CheckpointNow never came
    home.write_checkpoint(name, 150)

    # The next attempt runs on the other cluster, resumed from step 150, and only after the
    # first attempt's objects were deleted (never two live copies).
    admitted = await h.wait_event("ddp-1", "admitted", count=2)
    assert admitted.cluster == away.name and admitted.resume_from_step == 150
    second = await h.wait_event("ddp-1", "running", count=2)
    assert second.cluster == away.name and second.attempt == 2
    assert home.jobs() == [], "the first attempt's Job is still there"
    (job2,) = away.jobs()
    env = {
        e["name"]: e.get("value") for e in job2["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["MUSTER_ATTEMPT"] == "2" and env["MUSTER_RESUME_STEP"] == "150"
    assert env["MUSTER_RESUME_FROM"] == "s3://ckpt/ddp-1-a1-worker/150"

    # The Job controller reports success; the broker finishes the job with its accounting.
    away.complete(job2["metadata"]["name"])
    done = await h.wait_event("ddp-1", "succeeded")
    assert done.accounting is not None and done.accounting.attempts == 2
    view = await world.job("ddp-1")
    assert view["state"] == "succeeded" and view["latest_checkpoint"]["step"] == 150
    sampler.cancel()
    assert most_live == 1
