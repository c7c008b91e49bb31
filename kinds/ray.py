"""KubeRay RayJob (ray.io/v1, KubeRay v1.7): a RayCluster made for one job, then torn down;
and a RayCluster submitted on its own, which runs until it is cancelled.

An elastic worker group is resized in the RayCluster that runs it: a bare RayCluster's own,
or for a RayJob the one KubeRay made from it, named in the RayJob's `status.rayClusterName`:
KubeRay copies `spec.rayClusterSpec` into that RayCluster once and disregards later changes to
the RayJob's copy (ray-project/kuberay v1.7.0, `ray-operator/controllers/ray/rayjob_controller.go`
`getOrCreateRayClusterInstance`, Apache-2.0), so the groups' order, names and bounds are the
RayJob's and the agent never reads that RayCluster. The patch is a JSON patch (RFC 6902) on the
group's index, guarded by a `test` of its name: a CRD takes no strategic merge patch, and a
JSON merge patch would replace the whole `workerGroupSpecs` list, overwriting whatever else
changed in it.
KubeRay runs a group with `replicas` clamped to `[minReplicas, maxReplicas]`
(`controllers/ray/utils/util.go` `GetWorkerGroupDesiredReplicas`) and, with autoscaling off,
removes the pods named in `scaleStrategy.workersToDelete` first, else arbitrary ones
(`raycluster_controller.go` `reconcilePods`): a count outside the bounds is refused here, as
KubeRay would silently run another, and a shrink names the pods on the nodes it drops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from kinds.adapter import Adapter
from kinds.base import (
    KindError,
    PodTemplate,
    ReplicaRow,
    ResizeRefused,
    Resource,
    Verdict,
    elastic_job,
    ensure,
    keep_ttl,
    listed,
    mapping,
    pinned_nodes,
    replica_rows,
    template_at,
    verdict_reason,
)
from schemas.job import MAX_REPLICAS

_FAILED_JOB = frozenset({"FAILED", "STOPPED"})
RAYCLUSTER = Resource("ray.io/v1", "RayCluster", "rayclusters")
INT32_MAX = 2**31 - 1  # maxReplicas's default in the RayCluster CRD


def group_ops(
    live: Sequence[Any],
    new: Sequence[Any],
    path: str,
    leaving: Mapping[str, Sequence[str]],
    recreate: bool = False,
) -> list[dict[str, Any]]:
    """The JSON patch that takes a RayCluster's `spec.workerGroupSpecs` from `live` to the
    counts (and pod templates) of `new`: per changed group a `test` of its name at its index,
    its `replicas`, its template pinned to the group's nodes now, and on a shrink the pods
    leaving (`leaving`, by group) as `scaleStrategy.workersToDelete`. With `recreate` (KubeRay
    would recreate every pod on a template change) the template stays, and a growth whose
    pods need nodes it does not admit is refused."""
    wanted = {row.name: row for row in replica_rows(list(new), path, name_key="groupName")}
    ops: list[dict[str, Any]] = []
    for i, row in enumerate(replica_rows(list(live), path, name_key="groupName")):
        now = wanted.get(row.name)
        if now is None:
            continue
        low = row.replicas("minReplicas", default=0)
        was, size = row.replicas(default=low), now.replicas(default=low)
        if size == was:
            continue
        high = row.replicas("maxReplicas", default=INT32_MAX)
        if not low <= size <= high:
            raise ResizeRefused(
                f"{row.path}: KubeRay runs worker group {row.name!r} between its minReplicas "
                f"{low} and maxReplicas {high}, so it would not run {size} replicas"
            )
        at = f"/spec/workerGroupSpecs/{i}"
        ops += [
            {"op": "test", "path": f"{at}/groupName", "value": row.name},
            {"op": "add", "path": f"{at}/replicas", "value": size},
        ]
        template = now.spec.get("template") or {}
        pins, had = pinned_nodes(template), pinned_nodes(row.spec.get("template") or {})
        if recreate and had and not pins <= had:
            raise ResizeRefused(
                f"{row.path}: with spec.upgradeStrategy.type Recreate KubeRay recreates every "
                "pod when a worker template changes, so this group cannot grow onto "
                f"{', '.join(sorted(pins - had))} in place"
            )
        if pins != had and not recreate:
            ops.append({"op": "add", "path": f"{at}/template", "value": template})
        gone = sorted(leaving.get(row.name) or ())
        if size < was and gone:
            strategy = {"workersToDelete": gone}
            ops.append({"op": "add", "path": f"{at}/scaleStrategy", "value": strategy})
    return ops


class RayGroups(Adapter):
    """What a RayJob and a RayCluster share: a head group and worker groups, in the RayCluster
    spec at `cluster_path`."""

    podsets_doc = "`head` (1 pod) and each worker group's `groupName` (replicas x numOfHosts)"
    suspend_field = ("spec", "suspend")
    managed_by_field = ("spec", "managedBy")
    controllers = frozenset({"ray.io/kuberay-operator"})
    order = ("head",)
    resizable = True
    cluster_path = "spec"

    def _cluster(self, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
        return mapping(manifest.get("spec"), "spec", required=True)

    def _group_ops(
        self,
        live: Mapping[str, Any],
        new: Mapping[str, Any],
        leaving: Mapping[str, Sequence[str]],
        recreate: bool = False,
    ) -> list[dict[str, Any]]:
        path = f"{self.cluster_path}.workerGroupSpecs"
        was = listed(self._cluster(live).get("workerGroupSpecs"), path)
        now = listed(self._cluster(new).get("workerGroupSpecs"), path)
        return group_ops(was, now, path, leaving, recreate)

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        cluster = self._cluster(manifest)
        path = self.cluster_path
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
        path = f"{self.cluster_path}.workerGroupSpecs"
        groups = listed(self._cluster(manifest).get("workerGroupSpecs"), path)
        return replica_rows(groups, path, name_key="groupName")


class RayCluster(RayGroups):
    """A RayCluster submitted on its own: it runs until it is cancelled (KubeRay gives it no
    end), and its elastic worker groups resize in place."""

    resource = RAYCLUSTER
    has_status = False
    # KubeRay makes a RayCluster for every RayJob, with the RayJob's labels and annotations:
    # the front door must not take those for submissions.
    front_door = False
    retries_doc = "`enableInTreeAutoscaling: false`; no retries of its own"
    verdict_doc = "none: it runs until cancelled (its pods' phases tell a failure)"

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        ensure(manifest, "spec")["enableInTreeAutoscaling"] = False

    def resize_body(
        self, live: Mapping[str, Any], new: Mapping[str, Any], leaving: Mapping[str, Sequence[str]]
    ) -> list[dict[str, Any]]:
        """The JSON patch of its worker groups (module docstring). With
        `upgradeStrategy.type: Recreate` KubeRay recreates every pod when a template changes
        (`raycluster_controller.go` `shouldRecreatePodsForUpgrade`): templates stay, and a
        growth whose pods need other nodes is refused."""
        strategy = (self._cluster(live).get("upgradeStrategy") or {}).get("type")
        return self._group_ops(live, new, leaving, recreate=strategy == "Recreate")


class RayJob(RayGroups):
    resource = Resource("ray.io/v1", "RayJob", "rayjobs")
    cluster_path = "spec.rayClusterSpec"
    retries_doc = "`backoffLimit: 0`, `shutdownAfterJobFinishes: true`, in-tree autoscaling off"
    retry_field = ("spec", "backoffLimit")
    verdict_doc = (
        "`status.jobStatus` `SUCCEEDED` vs `FAILED`/`STOPPED`, or `jobDeploymentStatus: Failed`"
    )
    resized = RAYCLUSTER

    def resize_target(self, live: Mapping[str, Any]) -> str | None:
        """The RayCluster KubeRay created for the RayJob (`status.rayClusterName`)."""
        name = (live.get("status") or {}).get("rayClusterName")
        if not isinstance(name, str) or not name:
            what = (live.get("metadata") or {}).get("name", "")
            raise ResizeRefused(
                f"KubeRay has not named the RayCluster of RayJob {what} yet "
                "(status.rayClusterName is empty), so its workers cannot be resized now"
            )
        return name

    def resize_body(
        self, live: Mapping[str, Any], new: Mapping[str, Any], leaving: Mapping[str, Sequence[str]]
    ) -> list[dict[str, Any]]:
        """The JSON patch of the RayJob's RayCluster: each elastic worker group's new
        `replicas` (module docstring)."""
        return self._group_ops(live, new, leaving)

    def _cluster(self, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        if spec.get("clusterSelector") and not spec.get("rayClusterSpec"):
            raise KindError(
                "spec.clusterSelector: the job would run on an existing RayCluster Muster "
                "does not place; give spec.rayClusterSpec instead"
            )
        return mapping(spec.get("rayClusterSpec"), "spec.rayClusterSpec", required=True)

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
