"""KubeRay's RayJob and RayCluster controllers, as far as the API server stand-in models them
(opt-in: `FakeApiServer.kuberay`). Written from KubeRay v1.7.0 (ray-project/kuberay, commit
59d663aeec13760646da3db9c1cf8cfe883e30b7, Apache-2.0), not from Muster's code:

- a RayJob created through the API gets `status.rayClusterName` = `<rayjob>-<5 random
  characters>` (`utils.GenerateRayClusterName`, set in `rayjob_controller.go`
  `initRayJobStatusIfNeed`) and a RayCluster of that name whose `spec` is a copy of the RayJob's
  `spec.rayClusterSpec`, with the RayJob's labels and annotations plus
  `ray.io/originated-from-cr-name` and `ray.io/originated-from-crd: RayJob`, controlled by the
  RayJob (`constructRayClusterForRayJob`). Later changes to the RayJob's `rayClusterSpec` are
  disregarded (`getOrCreateRayClusterInstance`);
- `reconcile()` is one pass of `raycluster_controller.go` `reconcilePods` over the worker
  groups of every RayCluster: the pods named in `scaleStrategy.workersToDelete` are deleted
  and the list cleared, then the group runs `replicas` clamped to `[minReplicas, maxReplicas]`
  (`utils.GetWorkerGroupDesiredReplicas`; 0 when the group is suspended) times `numOfHosts`
  pods: missing ones are created from the group's template, surplus ones deleted in list
  order (autoscaling is off: KubeRay's "random" deletion takes the first pods it listed).

Not modelled: the head pod, services, the submitter Job, job status beyond the cluster name,
autoscaling, upgrade strategies, multi-host replica indexing.
"""

from __future__ import annotations

import copy
import random
from typing import TYPE_CHECKING, Any

from tests.kube.validation import validate

if TYPE_CHECKING:
    from tests.kube.fake_apiserver import FakeApiServer

Obj = dict[str, Any]

RAYJOBS = ("ray.io/v1", "rayjobs")
RAYCLUSTERS = ("ray.io/v1", "rayclusters")
PODS = ("v1", "pods")
# k8s.io/apimachinery/pkg/util/rand: the alphabet of rand.String (no vowels, no 0/1/3)
ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
INT32_MAX = 2**31 - 1


class KubeRay:
    """The two controllers, with their random names drawn from a seeded generator."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def _suffix(self) -> str:
        return "".join(self.rng.choice(ALPHABET) for _ in range(5))

    def rayjob_created(self, server: FakeApiServer, job: Obj) -> None:
        """The RayJob controller's first passes: name the RayCluster, then create it."""
        meta = job["metadata"]
        ns, name = meta["namespace"], meta["name"]
        cluster_name = f"{name}-{self._suffix()}"
        status = job.setdefault("status", {})
        status.update(rayClusterName=cluster_name, jobDeploymentStatus="Initializing")
        server.put(f"/apis/ray.io/v1/namespaces/{ns}/rayjobs", job)
        labels = dict(meta.get("labels") or {})
        labels["ray.io/originated-from-cr-name"] = name
        labels["ray.io/originated-from-crd"] = "RayJob"
        cluster = {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {
                "name": cluster_name,
                "namespace": ns,
                "labels": labels,
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "ray.io/v1",
                        "kind": "RayJob",
                        "name": name,
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": copy.deepcopy(job["spec"]["rayClusterSpec"]),
        }
        # KubeRay creates it through the API: the RayCluster CRD must take it.
        problems = validate(cluster)
        if problems:
            raise AssertionError(f"the API server would refuse KubeRay's RayCluster: {problems}")
        server.put(f"/apis/ray.io/v1/namespaces/{ns}/rayclusters", cluster)

    def reconcile(self, server: FakeApiServer) -> None:
        """One `reconcilePods` pass over every RayCluster's worker groups."""
        for (ns, _), cluster in list(server.store.get(RAYCLUSTERS, {}).items()):
            self._reconcile_cluster(server, ns, copy.deepcopy(cluster))

    def _reconcile_cluster(self, server: FakeApiServer, ns: str, cluster: Obj) -> None:
        name = cluster["metadata"]["name"]
        changed = False
        for group in cluster["spec"].get("workerGroupSpecs") or []:
            strategy = group.get("scaleStrategy") or {}
            for pod in strategy.get("workersToDelete") or []:
                server.delete(f"/api/v1/namespaces/{ns}/pods/{pod}")
            if strategy.get("workersToDelete"):
                strategy["workersToDelete"] = []
                changed = True
            pods = [
                p
                for (pns, _), p in server.store.get(PODS, {}).items()
                if pns == ns
                and (p["metadata"].get("labels") or {}).get("ray.io/cluster") == name
                and p["metadata"]["labels"].get("ray.io/group") == group["groupName"]
                and not p["metadata"].get("deletionTimestamp")
            ]
            diff = desired_pods(group) - len(pods)
            for _ in range(diff):
                self._create_worker(server, ns, cluster, group)
            for pod in pods[: max(0, -diff)]:
                server.delete(f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}")
        if changed:
            server.put(f"/apis/ray.io/v1/namespaces/{ns}/rayclusters", cluster)

    def _create_worker(self, server: FakeApiServer, ns: str, cluster: Obj, group: Obj) -> None:
        template = copy.deepcopy(group.get("template") or {})
        meta = template.get("metadata") or {}
        name = cluster["metadata"]["name"]
        labels = dict(meta.get("labels") or {})
        labels.update({"ray.io/cluster": name, "ray.io/group": group["groupName"]})
        labels["ray.io/node-type"] = "worker"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-{group['groupName']}-worker-{self._suffix()}",
                "namespace": ns,
                "labels": labels,
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "ray.io/v1",
                        "kind": "RayCluster",
                        "name": name,
                        "uid": cluster["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template.get("spec") or {},
            "status": {"phase": "Pending"},
        }
        server.put(f"/api/v1/namespaces/{ns}/pods", pod)


def desired_pods(group: Obj) -> int:
    """`GetWorkerGroupDesiredReplicas`: replicas clamped to [min, max], times numOfHosts."""
    if group.get("suspend"):
        return 0
    low = int(group.get("minReplicas") or 0)
    high = int(group.get("maxReplicas", INT32_MAX))
    replicas = group.get("replicas")
    count = low if replicas is None or replicas < low else min(int(replicas), high)
    return count * max(1, int(group.get("numOfHosts") or 1))
