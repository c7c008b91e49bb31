"""Elastic workloads of each resizable kind, the replica counts they shrink between, and the
Dispatch revision that asks for a new count: shared by the resize and RBAC tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from broker.manifests import jobspec_from_manifest
from schemas.agent import Dispatch, PodSetAssignment

FIXTURES = Path(__file__).parents[1] / "cli" / "fixtures"
EXAMPLES = Path(__file__).parents[2] / "examples" / "jobs"


def load_fixture(name: str) -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / name).read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def elastic_job() -> dict[str, Any]:
    """A batch/v1 Job Kueue may resize (its elastic-job annotation), 4 pods."""
    manifest = load_fixture("batch-job-indexed.yaml")
    annotations = manifest.setdefault("metadata", {}).setdefault("annotations", {})
    annotations["kueue.x-k8s.io/elastic-job"] = "true"
    manifest["spec"].update(parallelism=4, completions=4)
    manifest["spec"].pop("completionMode", None)
    return manifest


def elastic_volcano() -> dict[str, Any]:
    manifest = load_fixture("volcano-job.yaml")
    manifest["spec"]["minAvailable"] = 3
    return manifest


def elastic_rayjob(low: int = 1, high: int = 6) -> dict[str, Any]:
    """The example RayJob with its worker group elastic between `low` and `high`."""
    ray = yaml.safe_load((EXAMPLES / "rayjob.yaml").read_text(encoding="utf-8"))
    (group,) = ray["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    group.update(minReplicas=low, maxReplicas=high)
    ray["metadata"]["annotations"] = {"kueue.x-k8s.io/elastic-job": "true"}
    return ray  # type: ignore[no-any-return]


# What each resizable kind runs before and after a shrink (tests/kube/test_deploy.py checks
# that the agent's RBAC allows the patches).
SHRINKS: list[tuple[str, Any, dict[str, int], dict[str, int]]] = [
    ("kubeflow.org/v1/pytorchjobs", lambda: load_fixture("pytorchjob-elastic-spot.yaml"),
     {"worker": 4}, {"worker": 3}),
    ("batch/v1/jobs", elastic_job, {"worker": 4}, {"worker": 3}),
    ("batch.volcano.sh/v1alpha1/jobs", elastic_volcano, {"master": 1, "worker": 3},
     {"master": 1, "worker": 2}),
    # with KubeRay running (`FakeApiServer.kuberay`): the RayJob's RayCluster is patched
    ("ray.io/v1/rayclusters", elastic_rayjob, {"head": 1, "gpu-workers": 4},
     {"head": 1, "gpu-workers": 3}),
]  # fmt: skip


def elastic_dispatch(
    manifest: dict[str, Any], counts: dict[str, int], revision: int = 0, job_id: str = "j-1"
) -> Dispatch:
    return Dispatch(
        job_id=job_id,
        attempt=1,
        epoch=1,
        revision=revision,
        flavor="a100-spot",
        assignment=[
            PodSetAssignment(podset=p, nodes=[f"{p}-n{i}" for i in range(n)])
            for p, n in counts.items()
        ],
        spec=jobspec_from_manifest(manifest),
    )
