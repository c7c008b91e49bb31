"""The offline API-server validation and the scheduler stand-in refuse what the real ones do."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from tests.kube.scheduling import make_node, pods_from_template, schedule, unscheduled
from tests.kube.validation import causes, invalid_status, rejection, validate


def _job(**spec_extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train-a0", "namespace": "muster", "labels": {"a": "b"}},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "trainer", "image": "busybox"}],
                }
            },
            **spec_extra,
        },
    }


def _pin(obj: dict[str, Any], values: list[str]) -> None:
    obj["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": values}]}
                ]
            }
        }
    }


def test_a_valid_indexed_job_passes() -> None:
    assert validate(_job()) == []


def test_match_fields_takes_exactly_one_value_with_the_real_status_shape() -> None:
    job = _job()
    _pin(job, ["n1", "n2"])
    found = causes(job)
    assert [c.field for c in found] == [
        "spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchFields[0].values"
    ]
    status = invalid_status(job, found)
    assert status["kind"] == "Status" and status["code"] == 422 and status["reason"] == "Invalid"
    assert status["details"]["kind"] == "Job" and status["details"]["group"] == "batch"
    assert status["details"]["causes"][0]["reason"] == "FieldValueRequired"
    assert status["message"].startswith('Job.batch "train-a0" is invalid: ')
    one = _job()
    _pin(one, ["n1"])
    assert rejection(one) is None


def test_unknown_fields_and_wrong_types_are_refused_for_core_kinds() -> None:
    job = _job()
    job["spec"]["backoffLimitt"] = 0
    assert any("backoffLimitt" in e for e in validate(job))
    job = _job()
    job["spec"]["parallelism"] = "two"
    assert any(e.startswith("spec.parallelism") for e in validate(job))


def test_names_labels_and_job_pod_restart_policy() -> None:
    job = _job()
    job["metadata"]["name"] = "Train_A0"
    job["metadata"]["labels"] = {"muster.io/job-id": "ends-with-dash-"}
    job["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    fields = {c.field for c in causes(job)}
    assert {"metadata.name", "metadata.labels[muster.io/job-id]"} <= fields
    assert "spec.template.spec.restartPolicy" in fields


def test_custom_kinds_against_the_vendored_crd() -> None:
    pj: dict[str, Any] = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "pj", "namespace": "muster"},
        "spec": {
            "runPolicy": {"backoffLimit": 0},
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}},
                }
            },
        },
    }
    assert validate(pj) == []
    bad = copy.deepcopy(pj)
    bad["spec"]["runPolicy"]["maxRetry"] = 0
    assert any("maxRetry" in e for e in validate(bad))
    unknown = copy.deepcopy(pj)
    unknown["apiVersion"] = "kubeflow.org/v9"
    assert validate(unknown)


def test_trainjob_runtime_patch_containers_need_a_name_not_an_image() -> None:
    """The Trainer CRD requires only `name` on a runtimePatches container: the patch merges
    into the runtime's container, which has the image."""
    template = {"spec": {"containers": [{"name": "node"}]}}
    rjob = {"name": "node", "template": {"spec": {"template": template}}}
    tj: dict[str, Any] = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "tj", "namespace": "muster"},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {"numNodes": 2},
            "runtimePatches": [
                {
                    "manager": "muster",
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [rjob]}}},
                }
            ],
        },
    }
    assert validate(tj) == []
    nameless = copy.deepcopy(tj)
    del nameless["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ][0]["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
    assert validate(nameless)
    # A plain Job's container still needs its image.
    job = _job()
    del job["spec"]["template"]["spec"]["containers"][0]["image"]
    assert any("image" in e for e in validate(job))


def test_owner_references_need_their_keys_and_one_controller() -> None:
    ref = {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "u", "controller": True}
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "namespace": "muster", "ownerReferences": [ref]},
        "spec": {"clusterIP": "None", "ports": [{"port": 29500}]},
    }
    assert validate(svc) == []
    svc["metadata"]["ownerReferences"] = [ref, {**ref, "name": "k", "uid": "v"}]
    assert any("Only one reference" in e for e in validate(svc))
    svc["metadata"]["ownerReferences"] = [{**ref, "uid": ""}]
    assert any("ownerReferences[0].uid" in e for e in validate(svc))


def test_immutable_fields_on_update() -> None:
    old = _job()
    new = copy.deepcopy(old)
    new["spec"]["template"]["spec"]["containers"][0]["image"] = "other"
    assert any("spec.template" in e for e in validate(new, old))
    renamed = copy.deepcopy(old)
    renamed["metadata"]["name"] = "other"
    assert any(e.startswith("metadata.name") for e in validate(renamed, old))
    assert validate(copy.deepcopy(old), old) == []


def _gpu_pod_template(gpu: int, labels: dict[str, str], anti: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": str(gpu)}}}
        ]
    }
    if anti:
        spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": labels},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        }
    return {"metadata": {"labels": labels}, "spec": spec}


def test_anti_affinity_against_a_sibling_role_deadlocks_a_gang() -> None:
    """3 x 4 GPUs on two 8-GPU nodes: an anti-affinity that also matches the Master keeps a
    Worker Pending forever; one that matches only the Workers does not."""
    nodes = [make_node("n0"), make_node("n1")]
    shared = {"muster.io/podset": "trainer"}
    master = pods_from_template(_gpu_pod_template(4, shared, anti=True), 1, "master")
    workers = pods_from_template(_gpu_pod_template(4, shared, anti=True), 2, "worker")
    result = schedule(nodes, master + workers)
    stuck = unscheduled(result)
    assert len(stuck) == 1
    cond = stuck[0]["status"]["conditions"][0]
    assert cond["type"] == "PodScheduled" and cond["status"] == "False"
    assert cond["reason"] == "Unschedulable" and "anti-affinity" in cond["message"]

    worker_only = {"muster.io/podset": "trainer", "muster.io/role": "worker"}
    master = pods_from_template(_gpu_pod_template(4, {"muster.io/role": "master"}, False), 1, "m")
    workers = pods_from_template(_gpu_pod_template(4, worker_only, anti=True), 2, "w")
    for seed in range(5):
        assert unscheduled(schedule(nodes, master + workers, random.Random(seed))) == []


def test_taints_selectors_and_capacity() -> None:
    taint = {
        "key": "kubernetes.azure.com/scalesetpriority",
        "value": "spot",
        "effect": "NoSchedule",
    }
    nodes = [make_node("spot0", gpu=8, taints=[taint], labels={"pool": "spot"})]
    pod = pods_from_template(_gpu_pod_template(8, {}, False), 1, "p")
    assert (
        "untolerated taint"
        in unscheduled(schedule(nodes, pod))[0]["status"]["conditions"][0]["message"]
    )
    pod[0]["spec"]["tolerations"] = [{**taint, "operator": "Equal"}]
    pod[0]["spec"]["nodeSelector"] = {"pool": "spot"}
    assert unscheduled(schedule(nodes, pod)) == []
    two = pods_from_template(_gpu_pod_template(8, {}, False), 2, "q")
    for p in two:
        p["spec"]["tolerations"] = [{"operator": "Exists"}]
    left = unscheduled(schedule(nodes, two))
    assert (
        len(left) == 1
        and "Insufficient nvidia.com/gpu" in left[0]["status"]["conditions"][0]["message"]
    )


@pytest.mark.parametrize("op", ["In", "NotIn"])
def test_match_fields_and_hostname_pinning_schedule(op: str) -> None:
    nodes = [make_node(f"n{i}") for i in range(3)]
    tpl = _gpu_pod_template(8, {}, False)
    tpl["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": op, "values": ["n1"]}
                        ]
                    }
                ]
            }
        }
    }
    result = schedule(nodes, pods_from_template(tpl, 1, "p"))
    where = result[0]["spec"].get("nodeName")
    assert (where == "n1") if op == "In" else (where in ("n0", "n2"))
