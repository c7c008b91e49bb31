"""Multi-document job files and Kueue plain pod groups: one gang per group, one job per other
document; the agent creates each Pod of a group, pinned, and every Pod validates."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from agents.kube.config import build_workload
from broker.manifests import JobDocumentError, ManifestError, load_job_documents
from kinds.base import POD
from schemas.agent import Dispatch, PodSetAssignment
from tests.kube.conftest import make_config
from tests.kube.validation import validate

FILE = Path(__file__).parent / "fixtures" / "pod-group.yaml"


def test_a_file_of_a_pod_group_and_a_job_is_two_jobs() -> None:
    group, jobset = load_job_documents(FILE.read_text(), source="f")
    assert group.name == "sample-group" and group.queue == "user-queue"
    assert [(p.name, p.replicas, p.gpu) for p in group.gang] == [("pods", 1, 1), ("pods-2", 2, 2)]
    assert jobset.name == "after" and jobset.total_replicas == 2
    with pytest.raises(JobDocumentError, match="--job-id names one"):
        load_job_documents(FILE.read_text(), job_id="x", source="f")


def test_a_group_must_be_whole_in_the_file() -> None:
    docs = list(yaml.safe_load_all(FILE.read_text()))
    text = yaml.safe_dump_all(docs[:2])
    with pytest.raises(ManifestError, match="says 3 pods but the file holds 2"):
        load_job_documents(text, source="f")


def test_the_agent_creates_each_pod_of_the_group_pinned_and_valid() -> None:
    group, _ = load_job_documents(FILE.read_text(), source="f")
    cmd = Dispatch(
        job_id="g-1",
        attempt=1,
        epoch=1,
        flavor="a100-spot",
        assignment=[
            PodSetAssignment(podset="pods", nodes=["n0"]),
            PodSetAssignment(podset="pods-2", nodes=["n1", "n2"]),
        ],
        spec=msgspec.structs.replace(group, job_id="g-1"),
    )
    plan = build_workload(cmd, make_config().flavors[0], "muster-workloads")
    assert [o.resource for o in plan.objects] == [POD, POD, POD]
    assert plan.total_replicas == 3 and plan.podsets == ["pods", "pods-2"]
    for obj in plan.objects:
        assert validate(obj.body) == [], obj.name
        labels = obj.body["metadata"]["labels"]
        assert not [k for k in labels if k.startswith("kueue.x-k8s.io/")]
        assert obj.body["spec"]["restartPolicy"] == "Never"
    workers = [o.body for o in plan.objects[1:]]
    for w in workers:
        terms = w["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert sorted(t["matchFields"][0]["values"][0] for t in terms) == ["n1", "n2"]
        assert "podAntiAffinity" in w["spec"]["affinity"]
