"""Autoscaled pools end to end through the kube backend: the real broker and agent runtimes
over a real nats-server, two stand-in API servers, each with a Karpenter-like provisioner
(tests/kube/autoscaler.py) and a NodePool at zero nodes. A spot-only gang is accepted, only
the cheaper cluster is asked, its placeholder pods become NodeClaims and then Nodes, and the
gang runs on nodes that did not exist at submit; when that pool stocks out, the job moves to
the other cluster's pool."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from kubernetes_asyncio.client import ApiClient

from agents.kube.backend import KubeBackend
from agents.kube.pools import LABEL_ASK
from agents.runtime import AgentRuntime
from tests.e2e.conftest import World, kube_clusters
from tests.e2e.kube_providers import KubeCluster
from tests.kube.autoscaler import NODEPOOLS, Autoscaler, nodepool
from tests.kube.conftest import BASE_CONFIG, Clock, make_config
from tests.kube.fake_apiserver import FakeApiServer

GPU8 = {"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "In", "values": ["8"]}
SPOT = {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}
PRICES = {"east": 1.0, "west": 1.4}


@dataclass
class PooledCluster(KubeCluster):
    """A kube cluster whose GPU nodes come from its NodePool, on demand."""

    auto: Autoscaler | None = None

    async def play(self) -> None:
        assert self.auto is not None
        await asyncio.gather(super().play(), self.auto.run())

    def placeholders(self) -> list[dict[str, Any]]:
        return [p for p in self.server.items("v1", "pods") if LABEL_ASK in p["metadata"]["labels"]]


def spot_nodepool() -> dict[str, Any]:
    return nodepool(
        "gpu-spot",
        labels={"pool": "a100"},
        requirements=[SPOT, GPU8],
        taints=[{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
        limits={"nvidia.com/gpu": "32"},
    )


@asynccontextmanager
async def pooled_world(
    world: World, stockouts: set[str], window_s: float
) -> AsyncIterator[dict[str, PooledCluster]]:
    h = world.harness
    # Kube acks are real HTTP, and one loaded process runs broker, agents and API servers: a
    # stall of a second must not make the asked cluster unreachable (its gang would then be
    # planned on the other cluster's pool, a path this test is not about).
    timeouts = msgspec.structs.replace(
        h.config.timeouts, dispatch_ack_s=5.0, unreachable_after_s=15.0, lost_after_s=30.0
    )
    h.config = msgspec.structs.replace(h.config, timeouts=timeouts)

    def build(name: str, server: FakeApiServer, api: ApiClient) -> PooledCluster:
        server.put(NODEPOOLS, spot_nodepool())
        auto = Autoscaler(
            server,
            seed=len(name),
            delay_s=(0.2, 0.5),
            stockouts={"gpu-spot"} if name in stockouts else set(),
        )
        flavors = copy.deepcopy(BASE_CONFIG["flavors"])
        flavors[0]["price_per_gpu_hour"] = PRICES[name]
        clock = Clock(time.time())
        config = make_config(
            flavors=flavors,
            autoscaling={"provisioning_request": "off", "ready_s": 1.0, "window_s": window_s},
        )
        backend = KubeBackend(name, config, api_client=api, clock=clock, tick_s=0.05)
        runtime = AgentRuntime(backend, h.nc, subjects=h.subjects, heartbeat_s=0.2)
        return PooledCluster(name, server, api, runtime, clock, auto=auto)

    no_nodes: Callable[[str], list[dict[str, Any]]] = lambda name: []  # noqa: E731
    async with kube_clusters(world, no_nodes, build, termination_s=None) as clusters:
        yield clusters


GANG = {
    "name": "grown",
    "job_id": "grown-1",
    "gang": [{"name": "worker", "replicas": 2, "gpu": 8}],
    "capacity": "spot",
    "workload": {"image": "trainer:1", "command": ["torchrun", "train.py"]},
}


async def test_a_spot_gang_runs_on_nodes_its_nodepool_adds_and_only_one_cluster_scales(
    world: World,
) -> None:
    h = world.harness
    async with pooled_world(world, stockouts=set(), window_s=30.0) as clusters:
        east, west = clusters["east"], clusters["west"]
        assert not east.server.items("v1", "nodes") and not west.server.items("v1", "nodes")
        reply = await h.submit(GANG)
        assert reply.accepted, reply
        running = await h.wait_event("grown-1", "running", timeout=30)
        assert running.cluster == "east"
        assert east.auto is not None and west.auto is not None
        new_nodes = sorted(east.auto.launched)
        assert len(new_nodes) == 2
        (job,) = east.jobs()
        pods = east.pods_of(job["metadata"]["name"])
        assert sorted(p["spec"]["nodeName"] for p in pods) == new_nodes
        assert not west.auto.launched and not west.placeholders()  # west was never asked
        assert all(p["metadata"].get("deletionTimestamp") for p in east.placeholders())
        east.complete(job["metadata"]["name"])
        await h.wait_event("grown-1", "succeeded", timeout=15)


async def test_a_nodepool_stockout_moves_the_gang_to_the_other_cluster(world: World) -> None:
    h = world.harness
    async with pooled_world(world, stockouts={"east"}, window_s=3.0) as clusters:
        east, west = clusters["east"], clusters["west"]
        reply = await h.submit(GANG)
        assert reply.accepted, reply
        running = await h.wait_event("grown-1", "running", timeout=40)
        assert running.cluster == "west"
        assert east.auto is not None and west.auto is not None
        assert east.auto.failed_claims and not east.auto.launched
        assert len(west.auto.launched) == 2
        # what east was asked for is withdrawn once the broker's window has passed
        await h.wait_for(lambda: not east.placeholders(), 10)
