"""The agent's side of the job kinds: a flavor and the agent's configuration become the
`kinds.pods.PodPolicy` every template gets, and `build_workload` hands the Dispatch to the
kind adapters (`kinds/`, shared with the broker; see docs/kinds.md).

Names kept here for the backend: the label and annotation constants, the resources and the
label selectors of the objects Muster created.
"""

from __future__ import annotations

from typing import Any

from agents.kube.config import FlavorConfig, KubeBackendConfig
from kinds.base import (
    ANN_CHECKPOINT,
    ANN_CHECKPOINT_REQUEST,
    ANN_JOB,
    ANN_KIND,
    ANN_LEADER,
    ANN_ORIGINAL_NAME,
    ANN_TOTAL,
    HOSTNAME_KEY,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_PODSET,
    LABEL_ROLE,
    LABEL_SPREAD,
    LABEL_TOP,
    MANAGED_BY,
    POD,
    SERVICE,
    PodTemplate,
    Resource,
    podset_key,
)
from kinds.base import KindError as ManifestError
from kinds.batch import BATCH_JOB, COMPLETION_INDEX_ANN
from kinds.jobset import JobSet
from kinds.kubeflow import ADAPTERS as TRAINING
from kinds.plan import PlannedObject, WorkloadPlan, child_name, workload_name
from kinds.pods import PODINFO_DIR, PODINFO_VOLUME, PodPolicy, label_value, muster_env
from kinds.ray import RayJob
from kinds.registry import OWNED_RESOURCES, adapter_for, adapter_of
from kinds.trainer import TrainJob
from kinds.volcano import VolcanoJob
from kinds.workload import build_workload as _build
from schemas.agent import Dispatch

__all__ = [
    "ANN_CHECKPOINT",
    "ANN_CHECKPOINT_REQUEST",
    "ANN_JOB",
    "ANN_KIND",
    "ANN_LEADER",
    "ANN_ORIGINAL_NAME",
    "ANN_TOTAL",
    "BATCH_JOB",
    "COMPLETION_INDEX_ANN",
    "HOSTNAME_KEY",
    "JOBSET",
    "LABEL_ATTEMPT",
    "LABEL_JOB",
    "LABEL_MANAGED_BY",
    "LABEL_PODSET",
    "LABEL_ROLE",
    "LABEL_SPREAD",
    "LABEL_TOP",
    "MANAGED_BY",
    "MPIJOB",
    "OWNED_RESOURCES",
    "POD",
    "PODINFO_DIR",
    "PODINFO_VOLUME",
    "PYTORCHJOB",
    "RAYJOB",
    "SERVICE",
    "TFJOB",
    "TRAINJOB",
    "VOLCANO_JOB",
    "ManifestError",
    "PlannedObject",
    "Resource",
    "WorkloadPlan",
    "build_workload",
    "child_name",
    "label_value",
    "manifest_templates",
    "muster_env",
    "policy",
    "resource_for",
    "selector",
    "workload_name",
]


def _training(kind: str, api_version: str = "kubeflow.org/v1") -> Resource:
    return next(a.resource for a in TRAINING if a.handles(api_version, kind))


PYTORCHJOB = _training("PyTorchJob")
TFJOB = _training("TFJob")
MPIJOB = _training("MPIJob", "kubeflow.org/v2beta1")
JOBSET = JobSet.resource
VOLCANO_JOB = VolcanoJob.resource
RAYJOB = RayJob.resource
TRAINJOB = TrainJob.resource

# Notice window a spot flavor's pods get to checkpoint when none is configured: AWS gives two
# minutes; GCP and Azure 30 s (a longer grace there is harmless, the node goes first).
SPOT_GRACE_S = 120


def resource_for(api_version: str, kind: str) -> Resource:
    return adapter_for(api_version, kind).resource


def manifest_templates(manifest: dict[str, Any]) -> list[PodTemplate]:
    """The pod templates of a supported manifest with their podset names."""
    return adapter_of(manifest).templates(manifest)


def selector(job_id: str | None = None, attempt: int | None = None) -> str:
    """labelSelector for the objects Muster created (not their pods): every job's, one
    job's, or one attempt's."""
    sel = (
        f"{LABEL_TOP},{LABEL_JOB}"
        if job_id is None
        else f"{LABEL_TOP},{LABEL_JOB}={label_value(job_id)}"
    )
    return sel if attempt is None else f"{sel},{LABEL_ATTEMPT}={attempt}"


def policy(flavor: FlavorConfig, config: KubeBackendConfig | None = None) -> PodPolicy:
    """What the flavor and the agent's configuration add to every pod template."""
    grace = flavor.termination_grace_period_s
    if grace is None and flavor.capacity_type == "spot":
        grace = SPOT_GRACE_S
    return PodPolicy(
        node_labels=dict(flavor.node_labels),
        tolerations=[t.to_k8s() for t in flavor.tolerations],
        grace_seconds=grace,
        ttl_seconds=config.ttl_seconds_after_finished if config is not None else None,
        service_accounts=frozenset(
            config.allowed_service_accounts if config is not None else ("default",)
        ),
    )


def build_workload(
    cmd: Dispatch,
    flavor: FlavorConfig,
    namespace: str,
    gpu_resource: str = "nvidia.com/gpu",
    config: KubeBackendConfig | None = None,
) -> WorkloadPlan:
    """Dispatch -> the objects to create, by `spec.workload.kind`."""
    return _build(cmd, policy(flavor, config), namespace, gpu_resource)


__all__ += ["podset_key"]
