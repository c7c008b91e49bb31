"""End to end through the kube backend: the real broker, the real agent runtime with
`KubeBackend`, a real nats-server, and per cluster one stand-in Kubernetes API server
(`tests/kube/fake_apiserver.py`, validating every write; no real API server can be installed
here). The test plays the parts Kubernetes would: the Job controller creates the pods, the
scheduling helper (`tests/kube/scheduling.py`) binds them where a real scheduler would, the
kubelet runs them, the workload writes checkpoint annotations, and each cloud announces the
end of a spot node its own way. Everything between is Muster's own code.
"""

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
    rfc3339,
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
        clock = Clock(time.time())  # real time, moved on by tests that need grace to pass
        backend = KubeBackend(
            name,
            make_config(**provider_config(), not_ready_grace_s=120, allocatable_debounce_s=60),
            api_client=api,
            clock=clock,
            tick_s=0.05,
        )
        runtime = AgentRuntime(backend, h.nc, subjects=h.subjects, heartbeat_s=0.2)
        return KubeCluster(name, server, api, runtime, clock)

    # Pods terminate when the test says (termination_s=None).
    async with kube_clusters(world, provider_nodes, build, termination_s=None) as clusters:
        yield world, clusters


@pytest.mark.parametrize("kube_world", list(PROVIDERS), indirect=True)
async def test_spot_path_per_provider_resumes_from_checkpoint_on_another_cluster(
    kube_world: tuple[World, dict[str, KubeCluster]], request: pytest.FixtureRequest
) -> None:
    world, clusters = kube_world
    signal = PROVIDERS[request.node.callspec.params["kube_world"]][3]
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

    # The cloud announces the end of the node under replica 0, its own way.
    node_name = home.pods_of(name)[0]["spec"]["nodeName"]
    await signal(home, node_name, name)
    await h.wait_event("ddp-1", "preempting")

    # The agent asks the pods to checkpoint now (annotation); the workload answers at 150.
    def asked() -> bool:
        pods = home.pods_of(name)
        return bool(pods) and all(
            "muster.dev/checkpoint-request" in p["metadata"].get("annotations", {}) for p in pods
        )

    await h.wait_for(asked, 5)  # fails with "condition not met" if CheckpointNow never came
    home.write_checkpoint(name, 150)

    # The next attempt runs on the other cluster, resumed from step 150, and only after the
    # first attempt's Job was deleted (never two live copies).
    admitted = await h.wait_event("ddp-1", "admitted", count=2)
    assert admitted.cluster == away.name and admitted.resume_from_step == 150
    second = await h.wait_event("ddp-1", "running", count=2)
    assert second.cluster == away.name and second.attempt == 2
    assert home.jobs() == [], "the first attempt's Job is still there"
    home.server.finish_terminating()  # the old pods' grace ends
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
    assert not home.server.rejected and not away.server.rejected  # every write was valid


async def test_blips_end_no_attempt_but_not_ready_past_grace_does(
    kube_world: tuple[World, dict[str, KubeCluster]],
) -> None:
    """A device-plugin restart (8 -> 0 -> 8 within 30 s) and a NotReady of 10 s take the node
    out of new placements at most; NotReady past the grace (120 s here) loses the replicas only
    once the node is tainted out-of-service, and the job moves on. The agent's clock is
    driven: no test waits 30 s."""
    world, clusters = kube_world
    h = world.harness
    reply = await h.submit(
        {
            "name": "ddp",
            "job_id": "blip-1",
            "gang": [{"name": "worker", "replicas": 2, "gpu": 4}],
            "capacity": "spot",
            "workload": {"image": "trainer:1", "command": ["torchrun", "train.py"]},
        }
    )
    assert reply.accepted, reply
    first = await h.wait_event("blip-1", "running")
    home = clusters[first.cluster or ""]
    backend = home.runtime.backend
    assert isinstance(backend, KubeBackend)
    node_name = home.pods_of("blip-1-a1-worker")[0]["spec"]["nodeName"]
    assert h.broker is not None
    scheduler = h.broker.machine.scheduler

    def broker_node() -> Any:
        return scheduler.cluster_states()[home.name].nodes[node_name]

    def set_gpus(n: dict[str, Any], count: int) -> None:
        n["status"]["allocatable"]["nvidia.com/gpu"] = str(count)

    # GPU Operator upgrade: the device plugin restarts, allocatable 8 -> 0 -> 8 in 29 s.
    home.change_node(node_name, lambda n: set_gpus(n, 0))
    await h.wait_for(lambda: backend._nodes[node_name].dip_since is not None)
    home.clock.advance(29)
    backend.evaluate_timers()
    home.change_node(node_name, lambda n: set_gpus(n, 8))
    await h.wait_for(lambda: backend._nodes[node_name].dip_since is None)

    # NotReady for 10 s: the node takes no new pods meanwhile, then is back.
    def ready(n: dict[str, Any], status: str) -> None:
        n["status"]["conditions"][0].update(
            status=status, lastTransitionTime=rfc3339(home.clock.now)
        )

    home.change_node(node_name, lambda n: ready(n, "False"))
    await h.wait_for(lambda: broker_node().no_new_pods and broker_node().ready, 5)
    home.clock.advance(10)
    backend.evaluate_timers()
    home.change_node(node_name, lambda n: ready(n, "True"))
    await h.wait_for(lambda: not broker_node().no_new_pods, 5)
    assert h.kinds("blip-1").count("running") == 1
    assert not {"preempting", "requeued", "failed"} & set(h.kinds("blip-1"))

    # NotReady past the grace period proves nothing (a partitioned node keeps running its
    # containers) until the node is declared shut down: then the replicas are lost.
    home.change_node(node_name, lambda n: ready(n, "False"))
    await h.wait_for(lambda: broker_node().no_new_pods, 5)
    home.clock.advance(121)
    backend.evaluate_timers()
    assert broker_node().ready and h.kinds("blip-1").count("admitted") == 1

    def out_of_service(n: dict[str, Any]) -> None:
        n["spec"]["taints"] = [
            {"key": "node.kubernetes.io/out-of-service", "value": "x", "effect": "NoExecute"}
        ]

    home.change_node(node_name, out_of_service)
    again = await h.wait_event("blip-1", "admitted", count=2)
    assert again.attempt == 2
    assert "node" in ((await h.wait_event("blip-1", "requeued")).reason or "")
