"""Kueue's partial admission on a batch Job: the annotation becomes the podset's minimum, and a
dispatch with fewer nodes renders the Job with the admitted parallelism (and completions only
when the Job asks for them to follow parallelism, as Kueue does)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import yaml

from agents.kube.config import build_workload
from broker.manifests import ManifestError, jobspec_from_manifest
from schemas.agent import Dispatch, PodSetAssignment
from schemas.job import JobSpec
from tests.kube.conftest import make_config

NS = "muster-workloads"


def job_yaml(min_parallelism: str | None, equal: bool = False) -> dict[str, Any]:
    annotations = {}
    if min_parallelism is not None:
        annotations["kueue.x-k8s.io/job-min-parallelism"] = min_parallelism
    if equal:
        annotations["kueue.x-k8s.io/job-completions-equal-parallelism"] = "true"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "sample-job", "annotations": annotations},
        "spec": {
            "parallelism": 20,
            "completions": 20,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "dummy",
                            "image": "sleep:1",
                            "resources": {"requests": {"cpu": "1", "memory": "200Mi"}},
                        }
                    ],
                }
            },
        },
    }


def test_the_annotation_sets_the_podset_minimum() -> None:
    spec = jobspec_from_manifest(job_yaml("5"))
    (ps,) = spec.gang
    assert (ps.name, ps.replicas, ps.min_replicas) == ("worker", 20, 5)
    assert jobspec_from_manifest(job_yaml(None)).gang[0].min_replicas is None
    assert jobspec_from_manifest(job_yaml("20")).gang[0].min_replicas is None  # nothing to cut


@pytest.mark.parametrize(
    ("value", "text"),
    [("five", "is not a whole number"), ("0", "outside 1..20"), ("21", "outside 1..20")],
)
def test_a_bad_annotation_is_refused_clearly(value: str, text: str) -> None:
    with pytest.raises(ManifestError, match=text):
        jobspec_from_manifest(job_yaml(value))


def test_min_replicas_above_replicas_is_refused() -> None:
    bad = {"name": "x", "gang": [{"name": "w", "replicas": 2, "min_replicas": 3}]}
    with pytest.raises(msgspec.ValidationError, match="min_replicas 3 is more than its 2"):
        msgspec.convert(bad, JobSpec)


def _dispatch(manifest: dict[str, Any], nodes: int) -> Dispatch:
    spec = jobspec_from_manifest(manifest)
    return Dispatch(
        job_id="j-1",
        attempt=1,
        epoch=1,
        flavor="a100-spot",
        assignment=[PodSetAssignment(podset="worker", nodes=[f"n{i}" for i in range(nodes)])],
        spec=spec,
    )


@pytest.mark.parametrize(("equal", "completions"), [(False, 20), (True, 9)])
def test_a_partial_dispatch_renders_the_admitted_parallelism(equal: bool, completions: int) -> None:
    plan = build_workload(_dispatch(job_yaml("5", equal), 9), make_config().flavors[0], NS)
    (job,) = [o.body for o in plan.objects if o.body["kind"] == "Job"]
    assert job["spec"]["parallelism"] == 9
    assert job["spec"]["completions"] == completions
    assert plan.total_replicas == 9


def test_below_the_minimum_is_refused() -> None:
    with pytest.raises(Exception, match="has 4 nodes for 20 replicas"):
        build_workload(_dispatch(job_yaml("5"), 4), make_config().flavors[0], NS)


def test_the_whole_job_is_rendered_unchanged() -> None:
    plan = build_workload(_dispatch(job_yaml("5"), 20), make_config().flavors[0], NS)
    (job,) = [o.body for o in plan.objects if o.body["kind"] == "Job"]
    assert (job["spec"]["parallelism"], job["spec"]["completions"]) == (20, 20)
    assert yaml.safe_dump(job)  # still plain data
