"""Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2.3), the successor of
PyTorchJob. The pod template lives in the referenced runtime, so Muster derives the gang from
`spec.trainer` (`numNodes` x `resourcesPerNode`) and pins the pods through a `runtimePatches`
entry on the runtime's `node` replicated Job (its trainer container is named `node`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kinds.adapter import Adapter
from kinds.base import (
    DOMAIN,
    KindError,
    PodTemplate,
    Resource,
    Verdict,
    condition_verdict,
    count,
    ensure,
    mapping,
)

NODE_JOB = "node"  # the trainer's replicated Job and container in the Kubeflow runtimes
PATCH_MANAGER = f"{DOMAIN}/agent"


class TrainJob(Adapter):
    resource = Resource("trainer.kubeflow.org/v1alpha1", "TrainJob", "trainjobs")
    podsets_doc = "`node` (`spec.trainer.numNodes` pods of `resourcesPerNode`)"
    retries_doc = "not settable on a TrainJob: a failed pod fails the attempt and Muster deletes it"
    verdict_doc = "conditions `Complete` vs `Failed`"
    suspend_field = ("spec", "suspend")
    managed_by_field = ("spec", "managedBy")
    controllers = frozenset({"trainer.kubeflow.org/trainjob-controller"})

    def _nodes(self, manifest: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        trainer = mapping(spec.get("trainer"), "spec.trainer", required=True)
        if trainer.get("numNodes") is None:
            raise KindError(
                "spec.trainer.numNodes: missing; Muster reserves the gang before the runtime is "
                "read, so give the number of nodes (e.g. numNodes: 2)"
            )
        nodes = count(trainer.get("numNodes"), "spec.trainer.numNodes", 1)
        resources = mapping(trainer.get("resourcesPerNode"), "spec.trainer.resourcesPerNode")
        return nodes, resources

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        nodes, resources = self._nodes(manifest)
        demand = {"spec": {"containers": [{"name": NODE_JOB, "resources": dict(resources)}]}}
        return [PodTemplate(NODE_JOB, nodes, demand, False, NODE_JOB, "spec.trainer")]

    def patch_templates(self, manifest: dict[str, Any]) -> list[PodTemplate]:
        """The pod template of Muster's own `runtimePatches` entry (added once)."""
        nodes, _ = self._nodes(manifest)
        spec = ensure(manifest, "spec")
        patches = spec.get("runtimePatches")
        if not isinstance(patches, list):
            patches = spec["runtimePatches"] = []
        for p in patches:
            if isinstance(p, dict) and p.get("manager") == PATCH_MANAGER:
                rjobs = p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
                template = rjobs[0]["template"]["spec"]["template"]
                break
        else:
            template = {"metadata": {}, "spec": {"containers": [{"name": NODE_JOB}]}}
            patches.append(
                {
                    "manager": PATCH_MANAGER,
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": NODE_JOB, "template": {"spec": {"template": template}}}
                                ]
                            }
                        }
                    },
                }
            )
        return [PodTemplate(NODE_JOB, nodes, template, False, NODE_JOB, "spec.runtimePatches")]

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        return condition_verdict(f"TrainJob {name}", status, ("Complete",), ("Failed",))
