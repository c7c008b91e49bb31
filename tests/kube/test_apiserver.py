"""The stand-in API server refuses and behaves as a real one wherever the agent depends on it:
one test per validation rule (through the real client, answered with the real 422 Status),
selector transitions in watches, graceful deletion, finalizers, propagation, authentication."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client import ApiClient

from agents.kube.client import KubeApiError, KubeRest
from tests.kube.conftest import NODES, NS, PODS, Recorder, node, pod
from tests.kube.fake_apiserver import FakeApiServer

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
PYTORCHJOBS = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"

JOB: dict[str, Any] = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "j", "namespace": NS},
    "spec": {
        "completionMode": "Indexed",
        "completions": 2,
        "parallelism": 2,
        "backoffLimit": 0,
        "template": {
            "metadata": {"labels": {"app": "j"}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]},
        },
    },
}


def _pod_spec(j: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = j["spec"]["template"]["spec"]
    return spec


RULES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    # rule: (what breaks it, the field the 422 names)
    "schema: unknown field (strict)": (
        lambda j: _pod_spec(j)["containers"][0].update(imagePullPolcy="Always"),
        "spec.template.spec.containers[0]",
    ),
    "schema: required field": (
        lambda j: _pod_spec(j)["containers"][0].pop("image"),
        "spec.template.spec.containers[0].image",
    ),
    "node field selector takes one value": (
        lambda j: _pod_spec(j).update(
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": ["a", "b"]}
                                ]
                            }
                        ]
                    }
                }
            }
        ),
        "matchFields[0].values",
    ),
    "names are DNS-1123": (lambda j: j["metadata"].update(name="Bad_Name"), "metadata.name"),
    "label keys are qualified names": (
        lambda j: j["metadata"].update(labels={"bad key!": "v"}),
        "metadata.labels",
    ),
    "toleration Exists takes no value": (
        lambda j: _pod_spec(j).update(
            tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]
        ),
        "tolerations[0].operator",
    ),
    "Job pods restart Never or OnFailure": (
        lambda j: _pod_spec(j).update(restartPolicy="Always"),
        "spec.template.spec.restartPolicy",
    ),
    "anti-affinity needs a topology key": (
        lambda j: _pod_spec(j).update(
            affinity={
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": {"app": "j"}}, "topologyKey": ""}
                    ]
                }
            }
        ),
        "topologyKey",
    ),
}


@pytest.fixture
def rest(api_client: ApiClient) -> KubeRest:
    return KubeRest(api_client, 60.0)  # the first CRD validation compiles its schema


async def _refused(rest: KubeRest, collection: str, body: dict[str, Any]) -> KubeApiError:
    with pytest.raises(KubeApiError) as err:
        await rest.create(collection, body)
    return err.value


async def test_a_valid_job_is_accepted(apiserver: FakeApiServer, rest: KubeRest) -> None:
    assert await rest.create(JOBS, copy.deepcopy(JOB))


@pytest.mark.parametrize("rule", list(RULES))
async def test_each_validation_rule_fires_with_the_real_status(
    apiserver: FakeApiServer, rest: KubeRest, rule: str
) -> None:
    breaks, field = RULES[rule]
    body = copy.deepcopy(JOB)
    breaks(body)
    err = await _refused(rest, JOBS, body)
    assert err.status == 422 and err.detail.reason == "Invalid" and err.detail.code == 422
    assert f'Job.batch "{body["metadata"]["name"]}" is invalid' in err.detail.message
    (sent,) = apiserver.rejected
    assert any(field in c["field"] for c in sent["details"]["causes"]), sent
    assert apiserver.items("batch/v1", "jobs") == []  # nothing stored


async def test_custom_kinds_are_checked_against_their_crd(
    apiserver: FakeApiServer, rest: KubeRest
) -> None:
    body = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "p", "namespace": NS},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "i"}]}},
                }
            },
            "runPolicyy": {},
        },
    }
    err = await _refused(rest, PYTORCHJOBS, body)
    assert err.status == 422 and "runPolicyy" in err.detail.message


async def test_immutable_fields_stay(apiserver: FakeApiServer, rest: KubeRest) -> None:
    apiserver.authorizer = None  # a client allowed to patch Jobs (the agent is not)
    await rest.create(JOBS, copy.deepcopy(JOB))
    with pytest.raises(KubeApiError) as err:
        await rest.merge_patch(
            f"{JOBS}/j",
            {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "other"}]}}}},
        )
    assert err.value.status == 422 and "spec.template" in err.value.detail.message
    # Metadata stays mutable (the agent's checkpoint request is an annotation patch).
    assert await rest.merge_patch(f"{JOBS}/j", {"metadata": {"annotations": {"a": "b"}}})


@pytest.mark.parametrize(
    ("mode", "patch", "refusal"),
    [
        (
            "NonIndexed",
            {"completions": 3, "parallelism": 3},
            "spec.completions: field is immutable",
        ),
        ("Indexed", {"completions": 3}, "can only be modified in tandem with spec.parallelism"),
        ("Indexed", {"completions": 3, "parallelism": 3}, None),
        ("Indexed", {"completions": 1, "parallelism": 1}, None),
    ],
)
async def test_a_jobs_completions_change_only_with_parallelism_when_indexed(
    apiserver: FakeApiServer, rest: KubeRest, mode: str, patch: dict[str, int], refusal: str | None
) -> None:
    """Elastic Indexed Jobs (KEP-3715): `completions` may change together with, and equal to,
    `parallelism`; any other Job's completions are immutable."""
    apiserver.authorizer = None  # a client allowed to patch Jobs
    job = copy.deepcopy(JOB)
    job["spec"]["completionMode"] = mode
    await rest.create(JOBS, job)
    if refusal is None:
        assert await rest.merge_patch(f"{JOBS}/j", {"spec": patch})
        (stored,) = apiserver.items("batch/v1", "jobs")
        assert (stored["spec"]["completions"], stored["spec"]["parallelism"]) == (
            patch["completions"],
            patch["parallelism"],
        )
        return
    with pytest.raises(KubeApiError) as err:
        await rest.merge_patch(f"{JOBS}/j", {"spec": patch})
    assert err.value.status == 422 and refusal in err.value.detail.message
    (stored,) = apiserver.items("batch/v1", "jobs")
    assert stored["spec"]["completions"] == 2


async def test_unknown_field_selector_is_a_400(apiserver: FakeApiServer, rest: KubeRest) -> None:
    with pytest.raises(KubeApiError) as err:
        await rest.list_all("/api/v1/pods", dict, field_selector="spec.gpu=1")  # type: ignore[type-var]
    assert err.value.status == 400


async def _watch(server: FakeApiServer, path: str, **query: str) -> list[dict[str, Any]]:
    """Collect a watch's events until the server closes it (timeoutSeconds=1)."""
    out: list[dict[str, Any]] = []
    params = {"watch": "true", "timeoutSeconds": "1", **query}
    async with aiohttp.ClientSession() as s, s.get(server.url + path, params=params) as resp:
        async for line in resp.content:
            out.append(json.loads(line))
    return out


async def test_objects_leaving_a_selector_arrive_as_deleted(apiserver: FakeApiServer) -> None:
    p = apiserver.put("/api/v1/namespaces/t/pods", pod("a", "n1", "t"))
    since = p["metadata"]["resourceVersion"]
    done = copy.deepcopy(p)
    done["status"]["phase"] = "Succeeded"
    apiserver.put("/api/v1/namespaces/t/pods", done)
    labelled = apiserver.put(NODES, node("n1", labels={"gpu": "yes"}))
    moved = copy.deepcopy(labelled)
    moved["metadata"]["labels"]["gpu"] = "no"
    apiserver.put(NODES, moved)
    apiserver.put(NODES, labelled)
    pods = await _watch(
        apiserver, "/api/v1/pods", resourceVersion=since, fieldSelector="status.phase!=Succeeded"
    )
    assert [(e["type"], e["object"]["status"]["phase"]) for e in pods] == [("DELETED", "Running")]
    nodes = await _watch(apiserver, NODES, resourceVersion=since, labelSelector="gpu=yes")
    assert [e["type"] for e in nodes] == ["ADDED", "DELETED", "ADDED"]
    assert nodes[1]["object"]["metadata"]["labels"]["gpu"] == "yes"  # its previous content


async def test_graceful_deletion_finalizers_and_propagation(apiserver: FakeApiServer) -> None:
    apiserver.termination_s = None
    job = apiserver.put(JOBS, copy.deepcopy(JOB))
    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": "j",
        "uid": job["metadata"]["uid"],
        "controller": True,
    }
    bound = pod("j-0", "n1", namespace=NS)
    bound["metadata"]["ownerReferences"] = [owner]
    pending = pod("j-1", "", namespace=NS, phase="Pending")
    pending["metadata"]["ownerReferences"] = [owner]
    apiserver.put(PODS, bound)
    apiserver.put(PODS, pending)
    # Background: the Job goes at once; the bound pod stays Terminating for its grace, the
    # unscheduled one goes at once.
    apiserver.delete(f"{JOBS}/j", "Background")
    assert apiserver.get(f"{JOBS}/j") is None and apiserver.get(f"{PODS}/j-1") is None
    (terminating,) = apiserver.terminating()
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 30
    apiserver.finish_terminating()
    assert apiserver.items("v1", "pods") == []
    # A finalizer holds an object until it is removed.
    held = node("n9")
    held["metadata"]["finalizers"] = ["karpenter.sh/termination"]
    apiserver.put(NODES, held)
    apiserver.delete(f"{NODES}/n9")
    stored = apiserver.get(f"{NODES}/n9")
    assert stored is not None and stored["metadata"]["deletionTimestamp"]
    stored = copy.deepcopy(stored)
    stored["metadata"]["finalizers"] = []
    apiserver.put(NODES, stored)
    assert apiserver.get(f"{NODES}/n9") is None
    # Foreground: the owner stays (foregroundDeletion) until its dependents are gone.
    job = apiserver.put(JOBS, copy.deepcopy(JOB))
    child = pod("j-0", "n1", namespace=NS)
    child["metadata"]["ownerReferences"] = [{**owner, "uid": job["metadata"]["uid"]}]
    apiserver.put(PODS, child)
    apiserver.delete(f"{JOBS}/j", "Foreground")
    kept = apiserver.get(f"{JOBS}/j")
    assert kept is not None and kept["metadata"]["finalizers"] == ["foregroundDeletion"]
    apiserver.finish_terminating()
    await Recorder().wait_for(lambda: apiserver.get(f"{JOBS}/j") is None)


async def test_an_unknown_token_is_a_401(apiserver: FakeApiServer, rest: KubeRest) -> None:
    apiserver.tokens = {"good"}
    with pytest.raises(KubeApiError) as err:
        await rest.request("GET", NODES)
    assert err.value.status == 401 and apiserver.unauthorized == 1
    rest.api.configuration.api_key["BearerToken"] = "Bearer good"
    assert await rest.request("GET", NODES)
    apiserver.revoke("good")
    with pytest.raises(KubeApiError):
        await rest.request("GET", NODES)
