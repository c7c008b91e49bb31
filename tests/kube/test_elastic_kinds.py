"""Elastic podsets on Kubernetes objects: a dispatch of an elastic PyTorchJob or Volcano Job
renders the Worker (task) with the admitted count, within the kind's own bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from agents.kube.config import build_workload
from broker.manifests import jobspec_from_manifest
from schemas.agent import Dispatch, PodSetAssignment
from tests.kube.conftest import make_config

NS = "muster-workloads"
FIXTURES = Path(__file__).parents[1] / "cli" / "fixtures"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / name).read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _plan_of(manifest: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    spec = jobspec_from_manifest(manifest)
    cmd = Dispatch(
        job_id="j-1",
        attempt=1,
        epoch=1,
        flavor="a100-spot",
        assignment=[
            PodSetAssignment(podset=p, nodes=[f"n{i}" for i in range(n)]) for p, n in counts.items()
        ],
        spec=spec,
    )
    plan = build_workload(cmd, make_config().flavors[0], NS)
    (body,) = [o.body for o in plan.objects if o.body["kind"] == manifest["kind"]]
    return body


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_the_seed_elastic_pytorchjob_runs_its_admitted_workers(workers: int) -> None:
    body = _plan_of(_load("pytorchjob-elastic-spot.yaml"), {"worker": workers})
    assert body["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == workers
    assert body["spec"]["elasticPolicy"]["minReplicas"] == 2  # the policy itself stays


def test_a_volcano_job_runs_its_admitted_workers_above_min_available() -> None:
    manifest = _load("volcano-job.yaml")
    manifest["spec"]["minAvailable"] = 3
    body = _plan_of(manifest, {"master": 1, "worker": 2})
    tasks = {t["name"]: t["replicas"] for t in body["spec"]["tasks"]}
    assert tasks == {"master": 1, "worker": 2} and body["spec"]["minAvailable"] == 3


def _rayjob(elastic: bool) -> dict[str, Any]:
    root = Path(__file__).parents[2]
    ray = yaml.safe_load((root / "examples" / "jobs" / "rayjob.yaml").read_text(encoding="utf-8"))
    (group,) = ray["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    group.update(minReplicas=1, maxReplicas=6)
    if elastic:
        ray["metadata"]["annotations"] = {"kueue.x-k8s.io/elastic-job": "true"}
    return ray


def test_a_rayjob_worker_group_is_elastic_only_with_kueues_annotation() -> None:
    head, workers = jobspec_from_manifest(_rayjob(True)).gang
    assert (head.max_replicas, workers.min_replicas, workers.max_replicas) == (None, 1, 6)
    _, fixed = jobspec_from_manifest(_rayjob(False)).gang
    assert (fixed.replicas, fixed.max_replicas) == (2, None)


def test_an_elastic_rayjob_renders_its_admitted_workers() -> None:
    body = _plan_of(_rayjob(True), {"head": 1, "gpu-workers": 5})
    (group,) = body["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == 5
