"""Two stand-in kube clusters per cloud provider's spot flavor, behind the real broker and agent
runtime: each provider's node labels, taints and end-of-spot signal, and the `kube_world`
fixture (parametrize it indirectly with a provider's name; Karpenter v1 by default)."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from kubernetes_asyncio.client import ApiClient

from agents.kube.backend import KubeBackend
from agents.runtime import AgentRuntime
from tests.broker.conftest import Harness
from tests.e2e.conftest import kube_clusters
from tests.kube.conftest import (
    BASE_CONFIG,
    NODES,
    NS,
    PODS,
    Clock,
    job_owner,
    make_config,
    node,
)
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.scheduling import pods_from_template, schedule
from tests.world import World

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


@dataclass
class KubeCluster:
    """One cluster: its stand-in API server, its agent, and a loop playing the Job
    controller, the scheduler and the kubelet."""

    name: str
    server: FakeApiServer
    api: ApiClient
    runtime: AgentRuntime
    clock: Clock
    jobs_seen: set[str] = field(default_factory=set)

    def jobs(self) -> list[dict[str, Any]]:
        return self.server.items("batch/v1", "jobs")

    def pods_of(self, job_name: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.server.items("v1", "pods")
            if p["metadata"]["name"].startswith(job_name + "-")
        ]

    async def play(self) -> None:
        """For every Job Muster creates: its pods, bound by the scheduling helper, Running."""
        for _ in range(20_000):  # bounded: 20,000 x 10 ms
            for job in self.jobs():
                name = job["metadata"]["name"]
                if name in self.jobs_seen or job["metadata"].get("deletionTimestamp"):
                    continue
                self.jobs_seen.add(name)
                pods = pods_from_template(
                    job["spec"]["template"], job["spec"]["completions"], name, NS
                )
                for p in pods:
                    p["metadata"]["ownerReferences"] = [job_owner(job)]
                live = [
                    p
                    for p in self.server.items("v1", "pods")
                    if p["spec"].get("nodeName")
                    and p["status"].get("phase") not in ("Succeeded", "Failed")
                ]
                for p in schedule(self.server.items("v1", "nodes"), live + pods):
                    if p["spec"].get("nodeName"):
                        p["status"]["phase"] = "Running"
                    self.server.put(PODS, p)
            await asyncio.sleep(0.01)

    def write_checkpoint(self, job_name: str, step: int) -> None:
        """What the checkpoint SDK does in a pod: annotate itself with the newest checkpoint."""
        for p in self.pods_of(job_name):
            p = copy.deepcopy(p)
            p["metadata"].setdefault("annotations", {})["muster.dev/checkpoint"] = json.dumps(
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

    def change_node(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        obj = copy.deepcopy(self.server.get(f"{NODES}/{name}"))
        assert obj is not None
        change(obj)
        self.server.put(NODES, obj)


def _taint(key: str, value: str = "") -> Callable[[dict[str, Any]], None]:
    def apply(n: dict[str, Any]) -> None:
        n["spec"].setdefault("taints", []).append(
            {"key": key, "value": value, "effect": "NoSchedule"}
        )

    return apply


def _cordon(n: dict[str, Any]) -> None:
    n["spec"]["unschedulable"] = True


async def karpenter_v1(c: KubeCluster, node_name: str, job: str) -> None:
    """The interruption controller deletes the NodeClaim: the Node (held by Karpenter's
    finalizer) gets its deletionTimestamp first, then the disrupted taint."""
    c.change_node(
        node_name, lambda n: n["metadata"].update(finalizers=["karpenter.sh/termination"])
    )
    c.server.delete(f"{NODES}/{node_name}")
    c.change_node(node_name, _taint("karpenter.sh/disrupted"))


async def nth_cordon_and_drain(c: KubeCluster, node_name: str, job: str) -> None:
    """aws-node-termination-handler's default: cordon, then drain through the eviction API
    (the pods get DisruptionTarget and stay Terminating for their grace period)."""
    c.change_node(node_name, _cordon)
    for p in c.pods_of(job):
        if p["spec"]["nodeName"] != node_name:
            continue
        p = copy.deepcopy(p)
        p["status"]["conditions"] = [
            *(p["status"].get("conditions") or []),
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
        ]
        c.server.put(PODS, p)
        c.server.delete(f"{PODS}/{p['metadata']['name']}")


async def nth_taints(c: KubeCluster, node_name: str, job: str) -> None:
    c.change_node(node_name, _taint("aws-node-termination-handler/spot-itn", "evt-0123"))
    c.change_node(node_name, _cordon)


async def gke(c: KubeCluster, node_name: str, job: str) -> None:
    c.change_node(node_name, _taint("cloud.google.com/impending-node-termination"))


async def aks(c: KubeCluster, node_name: str, job: str) -> None:
    """AKS node auto-drain on a Preempt scheduled event: taint, cordon."""
    c.change_node(node_name, _taint("remediator.kubernetes.azure.com/unschedulable"))
    c.change_node(node_name, _cordon)


Signal = Callable[[KubeCluster, str, str], Awaitable[None]]
AZURE_SPOT_TAINT = {"key": "kubernetes.azure.com/scalesetpriority", "value": "spot"}
PROVIDERS: dict[str, tuple[dict[str, str], str, list[dict[str, str]], Signal]] = {
    # name: (node labels, providerID prefix, permanent taints, the cloud's signal)
    "karpenter-v1": (
        {"karpenter.sh/capacity-type": "spot"},
        "aws:///us-east-1a/",
        [],
        karpenter_v1,
    ),
    "nth-cordon-drain": (
        {"eks.amazonaws.com/capacityType": "SPOT"},
        "aws:///us-east-1a/",
        [],
        nth_cordon_and_drain,
    ),
    "nth-taints": (
        {"eks.amazonaws.com/capacityType": "SPOT"},
        "aws:///us-east-1a/",
        [],
        nth_taints,
    ),
    "gke": ({"cloud.google.com/gke-spot": "true"}, "gce://proj/us-central1-a/", [], gke),
    "aks": (
        {"kubernetes.azure.com/scalesetpriority": "spot"},
        "azure:///subscriptions/s/virtualMachineScaleSets/v/virtualMachines/",
        [{**AZURE_SPOT_TAINT, "effect": "NoSchedule"}],
        aks,
    ),
}


def provider_config() -> dict[str, Any]:
    """The base flavors, the spot one tolerating the Azure spot taint as AKS needs."""
    flavors = copy.deepcopy(BASE_CONFIG["flavors"])
    flavors[0]["tolerations"].append(
        {**AZURE_SPOT_TAINT, "operator": "Equal", "effect": "NoSchedule"}
    )
    return {"flavors": flavors}


def provider_cluster(
    h: Harness, name: str, server: FakeApiServer, api: ApiClient, **config: Any
) -> KubeCluster:
    """One cluster's agent (`KubeBackend` with the provider flavors and `config`) on the
    harness's NATS, on real time (tests that need grace to pass move its clock on)."""
    clock = Clock(time.time())
    backend = KubeBackend(
        name,
        make_config(**provider_config(), **config),
        api_client=api,
        clock=clock,
        tick_s=0.05,
    )
    runtime = AgentRuntime(backend, h.nc, subjects=h.subjects, heartbeat_s=0.2)
    return KubeCluster(name, server, api, runtime, clock)


@pytest_asyncio.fixture
async def kube_world(
    world: World, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[World, dict[str, KubeCluster]]]:
    h: Harness = world.harness
    labels, provider_id, taints, _ = PROVIDERS[getattr(request, "param", "karpenter-v1")]
    # A kube dispatch is real HTTP (a Service and a Job, each validated): give its ack the
    # time a loaded machine needs, not the fake fleet's 0.3 s.
    h.config = msgspec.structs.replace(
        h.config, timeouts=msgspec.structs.replace(h.config.timeouts, dispatch_ack_s=5.0)
    )

    def provider_nodes(name: str) -> list[dict[str, Any]]:
        out = []
        for i in range(2):
            n = node(f"{name}-n{i}", labels=labels, provider_id=f"{provider_id}{name}{i}")
            n["spec"]["taints"] = copy.deepcopy(taints)
            out.append(n)
        return out

    def build(name: str, server: FakeApiServer, api: ApiClient) -> KubeCluster:
        return provider_cluster(
            h, name, server, api, not_ready_grace_s=120, allocatable_debounce_s=60
        )

    # Pods terminate when the test says (termination_s=None).
    async with kube_clusters(world, provider_nodes, build, termination_s=None) as clusters:
        yield world, clusters
