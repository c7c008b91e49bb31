"""Two stand-in kube clusters of Karpenter spot nodes behind the real broker and agent runtime,
playing each workload kind's controller: the `kube_world` fixture, the example manifests, and
running a manifest on spot until it runs."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest_asyncio
import yaml
from kubernetes_asyncio.client import ApiClient

from agents.kube.backend import KubeBackend
from agents.runtime import AgentRuntime
from kinds import OWNED_RESOURCES, adapter_of
from kinds.base import ANN_CHECKPOINT, LABEL_JOB, LABEL_TOP, POD, SERVICE
from tests.broker.conftest import Harness
from tests.e2e.conftest import kube_clusters
from tests.kube.conftest import NODES, NS, PODS, make_config, node
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.scheduling import Cluster, pods_from_template, unscheduled
from tests.kube.validation import validate
from tests.world import World

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "jobs"
SPOT_TAINT = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}
WORKLOAD_KINDS = [r for r in OWNED_RESOURCES if r not in (SERVICE, POD)]

# What each kind's controller writes into status when the job succeeded.
SUCCESS: dict[str, dict[str, Any]] = {
    "batch": {"conditions": [{"type": "Complete", "status": "True"}]},
    "kubeflow.org": {"conditions": [{"type": "Succeeded", "status": "True"}]},
    "jobset.x-k8s.io": {"conditions": [{"type": "Completed", "status": "True"}]},
    "batch.volcano.sh": {"state": {"phase": "Completed"}},
    "ray.io": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"},
    "trainer.kubeflow.org": {"conditions": [{"type": "Complete", "status": "True"}]},
}


@dataclass
class KubeCluster:
    name: str
    server: FakeApiServer
    api: ApiClient
    runtime: AgentRuntime
    seen: set[str] = field(default_factory=set)
    refused: list[str] = field(default_factory=list)

    def workloads(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for r in WORKLOAD_KINDS:
            for obj in self.server.items(r.api_version, r.plural):
                if LABEL_TOP in obj["metadata"].get("labels", {}):
                    out.append((r.collection(NS), obj))
        return out

    def pods(self, job_id: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.server.items("v1", "pods")
            if p["metadata"].get("labels", {}).get(LABEL_JOB) == job_id
        ]

    async def play(self) -> None:
        """Operators + scheduler + kubelet: pods for every new workload object, bound where
        the written templates allow, Running."""
        for _ in range(20_000):  # bounded: 20,000 x 10 ms
            for _, obj in self.workloads():
                uid = obj["metadata"]["uid"]
                if uid in self.seen:
                    continue
                self.seen.add(uid)
                body = copy.deepcopy({k: v for k, v in obj.items() if k != "status"})
                for key in ("uid", "resourceVersion", "creationTimestamp"):
                    body["metadata"].pop(key, None)
                problems = await asyncio.to_thread(validate, body)
                self.refused += [f"{obj['metadata']['name']}: {e}" for e in problems]
                pods = []
                for t in adapter_of(body).patch_templates(body):
                    prefix = f"{obj['metadata']['name']}-{t.role}"
                    pods += pods_from_template(t.template, t.replicas, prefix, NS)
                nodes = self.server.items("v1", "nodes")
                cluster = Cluster(nodes)
                cluster.schedule(
                    [p for p in self.server.items("v1", "pods") if p["spec"].get("nodeName")]
                )
                placed = cluster.schedule(pods)
                self.refused += [f"{p['metadata']['name']} Pending" for p in unscheduled(placed)]
                owner = {
                    "apiVersion": obj["apiVersion"],
                    "kind": obj["kind"],
                    "name": obj["metadata"]["name"],
                    "uid": uid,
                    "controller": True,
                }
                for p in placed:
                    p["metadata"]["ownerReferences"] = [owner]  # deleted with the object
                    p["status"] = {"phase": "Running"}
                    self.server.put(PODS, p)
            self._bind_bare_pods()
            await asyncio.sleep(0.01)

    def _bind_bare_pods(self) -> None:
        """The scheduler and kubelet for Pods Muster creates itself (a pod group)."""
        all_pods = self.server.items("v1", "pods")
        bare = [
            p
            for p in all_pods
            if LABEL_TOP in p["metadata"].get("labels", {}) and not p["spec"].get("nodeName")
        ]
        if not bare:
            return
        self.refused += [
            f"{p['metadata']['name']}: {e}"
            for p in bare
            for e in validate(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        k: v
                        for k, v in p["metadata"].items()
                        if k not in ("uid", "resourceVersion", "creationTimestamp")
                    },
                    "spec": p["spec"],
                }
            )
        ]
        cluster = Cluster(self.server.items("v1", "nodes"))
        cluster.schedule([p for p in all_pods if p["spec"].get("nodeName")])
        placed = cluster.schedule(bare)
        self.refused += [f"{p['metadata']['name']} Pending" for p in unscheduled(placed)]
        for p in placed:
            p["status"] = {"phase": "Running"}
            self.server.put(PODS, p)

    def write_checkpoint(self, job_id: str, step: int) -> None:
        for p in self.pods(job_id):
            p = copy.deepcopy(p)
            p["metadata"]["annotations"][ANN_CHECKPOINT] = json.dumps(
                {"step": step, "uri": f"s3://ckpt/{job_id}/{step}"}
            )
            self.server.put(PODS, p)

    def reclaim_pool(self) -> None:
        """The cloud reclaims the cluster's whole spot pool: every node gets the notice."""
        for n in self.server.items("v1", "nodes"):
            tainted = copy.deepcopy(n)
            tainted["spec"]["taints"] = [SPOT_TAINT]
            self.server.put(NODES, tainted)

    def succeed(self) -> None:
        for p in self.server.items("v1", "pods"):
            if LABEL_TOP in p["metadata"].get("labels", {}):  # a pod group: the pods end
                done = copy.deepcopy(p)
                done["status"] = {"phase": "Succeeded"}
                self.server.put(PODS, done)
        for collection, obj in self.workloads():
            group = obj["apiVersion"].rpartition("/")[0]
            done = copy.deepcopy(obj)
            done["status"] = SUCCESS[group]
            self.server.put(collection, done)


@pytest_asyncio.fixture
async def kube_world(world: World) -> AsyncIterator[tuple[World, dict[str, KubeCluster]]]:
    await asyncio.to_thread(_compile_validators)  # seconds of CPU, never on the event loop
    h: Harness = world.harness

    def build(name: str, server: FakeApiServer, api: ApiClient) -> KubeCluster:
        backend = KubeBackend(name, make_config(), api_client=api)
        runtime = AgentRuntime(backend, h.nc, subjects=h.subjects, heartbeat_s=0.2)
        return KubeCluster(name, server, api, runtime)

    async with kube_clusters(world, spot_nodes, build) as clusters:
        yield world, clusters


def spot_nodes(name: str) -> list[dict[str, Any]]:
    """Two Karpenter spot nodes of the cluster `name`."""
    labels = {"karpenter.sh/capacity-type": "spot"}
    return [
        node(f"{name}-n{i}", labels={**labels, "kubernetes.io/hostname": f"{name}-n{i}"})
        for i in range(2)
    ]


async def run_on_spot(
    world: World, clusters: dict[str, KubeCluster], manifest: dict[str, Any], job_id: str
) -> tuple[KubeCluster, KubeCluster]:
    """Submit the manifest as `job_id` on spot capacity, checkpointing below s3://ckpt, and
    wait until it runs: (the cluster it runs on, the other one)."""
    manifest["metadata"].setdefault("annotations", {}).update(
        {
            "muster.dev/job-id": job_id,
            "muster.dev/capacity": "spot",
            "muster.dev/checkpoint-uri": f"s3://ckpt/{job_id}",
        }
    )
    reply = await world.harness.submit(manifest, queue="default")
    assert reply.accepted, reply
    first = await world.harness.wait_event(job_id, "running")
    home = clusters[first.cluster or ""]
    return home, clusters["west" if home.name == "east" else "east"]


def _compile_validators() -> None:
    for path in EXAMPLE_FILES:
        validate(yaml.safe_load(path.read_text()))


POD_GROUP = Path(__file__).resolve().parents[1] / "kube" / "fixtures" / "pod-group.yaml"
# Every example job of a kind that ends on its own: not the JobSpec, and not the RayCluster,
# which runs until cancelled (its resizes: tests/kube/test_ray_resize.py).
EXAMPLE_FILES = sorted(
    p for p in EXAMPLES.glob("*.yaml") if p.name not in ("jobspec.yaml", "raycluster.yaml")
)
