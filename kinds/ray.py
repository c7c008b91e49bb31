"""KubeRay RayJob (ray.io/v1, KubeRay v1.7): a RayCluster made for one job, then torn down."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from kinds.adapter import Adapter
from kinds.base import (
    KindError,
    PodTemplate,
    ReplicaRow,
    Resource,
    Verdict,
    elastic_job,
    ensure,
    keep_ttl,
    listed,
    mapping,
    replica_rows,
    template_at,
    verdict_reason,
)
from schemas.job import MAX_REPLICAS

_FAILED_JOB = frozenset({"FAILED", "STOPPED"})


class RayJob(Adapter):
    resource = Resource("ray.io/v1", "RayJob", "rayjobs")
    podsets_doc = "`head` (1 pod) and each worker group's `groupName` (replicas x numOfHosts)"
    retries_doc = "`backoffLimit: 0`, `shutdownAfterJobFinishes: true`, in-tree autoscaling off"
    retry_field = ("spec", "backoffLimit")
    suspend_field = ("spec", "suspend")
    managed_by_field = ("spec", "managedBy")
    controllers = frozenset({"ray.io/kuberay-operator"})
    verdict_doc = (
        "`status.jobStatus` `SUCCEEDED` vs `FAILED`/`STOPPED`, or `jobDeploymentStatus: Failed`"
    )
    order = ("head",)

    def _cluster(self, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        if spec.get("clusterSelector") and not spec.get("rayClusterSpec"):
            raise KindError(
                "spec.clusterSelector: the job would run on an existing RayCluster Muster "
                "does not place; give spec.rayClusterSpec instead"
            )
        return mapping(spec.get("rayClusterSpec"), "spec.rayClusterSpec", required=True)

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        cluster = self._cluster(manifest)
        path = "spec.rayClusterSpec"
        head = mapping(cluster.get("headGroupSpec"), f"{path}.headGroupSpec", required=True)
        out = [
            PodTemplate(
                "head",
                1,
                template_at(head.get("template"), f"{path}.headGroupSpec.template"),
                False,
                "head",
                f"{path}.headGroupSpec",
            )
        ]
        for row in self._groups(manifest):
            if row.name == "head":
                raise KindError(f"{row.path}.groupName: 'head' names the head group; rename it")
            replicas = row.replicas(default=row.replicas("minReplicas"))
            hosts = row.replicas("numOfHosts")
            out.append(
                PodTemplate(row.name, replicas * hosts, row.template(), False, row.name, row.path)
            )
        return out

    def elastic(self, manifest: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """With `kueue.x-k8s.io/elastic-job: "true"`, a worker group of one host per replica
        runs between its `minReplicas` (at least 1) and `maxReplicas` (else its `replicas`):
        the sizes KubeRay's autoscaler would choose between. Multi-host groups stay whole."""
        if not elastic_job(manifest):
            return {}
        out: dict[str, tuple[int, int]] = {}
        for row in self._groups(manifest):
            if row.replicas("numOfHosts") != 1:
                continue
            size = row.replicas(default=row.replicas("minReplicas"))
            low = max(1, row.replicas("minReplicas", default=size))
            high = min(MAX_REPLICAS, row.replicas("maxReplicas", default=size))
            if not low <= size <= high:
                raise KindError(
                    f"{row.path}: minReplicas {low}, replicas {size} and maxReplicas {high} must "
                    "satisfy minReplicas <= replicas <= maxReplicas for an elastic job"
                )
            if low < high:
                out[row.name] = (low, high)
        return out

    def scale(self, manifest: dict[str, Any], podset: str, count: int) -> None:
        """An elastic worker group runs with its admitted count (autoscaling is off)."""
        if podset not in self.elastic(manifest):
            super().scale(manifest, podset, count)
        for row in self._groups(manifest):
            if row.name == podset:
                cast("dict[str, Any]", row.spec)["replicas"] = count

    def _groups(self, manifest: Mapping[str, Any]) -> list[ReplicaRow]:
        path = "spec.rayClusterSpec.workerGroupSpecs"
        groups = listed(self._cluster(manifest).get("workerGroupSpecs"), path)
        return replica_rows(groups, path, name_key="groupName")

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        spec = ensure(manifest, "spec")
        spec["backoffLimit"] = 0
        spec["shutdownAfterJobFinishes"] = True
        cluster = ensure(spec, "rayClusterSpec")
        cluster["enableInTreeAutoscaling"] = False

    def set_ttl(self, manifest: dict[str, Any], seconds: int) -> None:
        keep_ttl(ensure(manifest, "spec"), seconds)

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        what = f"RayJob {name}"
        job_status = str(status.get("jobStatus") or "")
        deployment = str(status.get("jobDeploymentStatus") or "")
        reason, message = status.get("reason"), status.get("message")
        if deployment == "Failed" or job_status in _FAILED_JOB:
            return Verdict(
                "failed", verdict_reason(what, job_status or deployment, reason, message)
            )
        if job_status == "SUCCEEDED":
            return Verdict("succeeded", verdict_reason(what, job_status, reason, message))
        return None
