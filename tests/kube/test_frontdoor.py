"""The front door's pieces: the job id, the spec hash that tells an edit from a re-apply, what
the broker gets, what the home object shows, its config, and that an ended job is never run
again after a restart (on the stand-in API server)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_asyncio.client import ApiClient

from agents.config import AgentConfig, FrontDoorConfig
from agents.fleet import _runtime
from agents.kube.backend import KubeBackend
from agents.kube.client import MERGE_PATCH, KubeApiError, KubeRest
from agents.kube.frontdoor import (
    ANN_JOB,
    ANN_SPEC,
    ANN_STATE,
    FINALIZER,
    WATCHED,
    FrontDoor,
    job_id_for,
    spec_hash,
    submitted_manifest,
    suspend_of,
    verdict_of,
)
from broker.manifests import jobspec_from_manifest
from schemas.subjects import Subjects
from tests.kube.conftest import NS, make_config
from tests.kube.fake_apiserver import FakeApiServer
from tests.support import DEPLOY

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "pytorchjob.yaml"
SUSPEND = ("spec", "runPolicy", "suspend")
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")


def marked() -> dict[str, Any]:
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"] = {
        "name": "ddp",
        "namespace": NS,
        "uid": "0b9f3c2e-6f1a-4d1e-9c3b-2a1f5e7d9c11",
        "resourceVersion": "7",
        "labels": {"kueue.x-k8s.io/queue-name": "research", "team": "vision"},
        "annotations": {
            "kubectl.kubernetes.io/last-applied-configuration": "{}",
            ANN_JOB: "kube-old",
            "owner": "ana",
        },
        "finalizers": [FINALIZER],
    }
    job["spec"]["runPolicy"] = {"suspend": True}
    return dict(job)


@settings(max_examples=50, deadline=None)
@given(uid=st.uuids().map(str), digest=st.text("0123456789abcdef", min_size=16, max_size=16))
def test_job_ids_are_valid_stable_and_differ_per_edit(uid: str, digest: str) -> None:
    first, edited = job_id_for(uid, digest, True), job_id_for(uid, digest, False)
    assert JOB_ID.match(first) and JOB_ID.match(edited)
    assert first == job_id_for(uid, "another", True)  # the first id is the UID's alone
    assert edited != first and edited.startswith(first)


@settings(max_examples=50, deadline=None)
@given(
    suspend=st.booleans(),
    workers=st.integers(min_value=1, max_value=64),
    queue=st.sampled_from(["research", "default"]),
)
def test_the_spec_hash_ignores_suspend_and_sees_every_edit(
    suspend: bool, workers: int, queue: str
) -> None:
    base = marked()
    other = copy.deepcopy(base)
    other["spec"]["runPolicy"]["suspend"] = suspend
    other["metadata"]["labels"]["extra"] = "label changes are not edits"
    assert spec_hash(other, SUSPEND, "research") == spec_hash(base, SUSPEND, "research")
    other["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = workers
    same = workers == 2 and queue == "research"
    assert (spec_hash(other, SUSPEND, queue) == spec_hash(base, SUSPEND, "research")) == same


def test_the_broker_gets_the_users_object_unsuspended_without_muster_marks() -> None:
    out = submitted_manifest(marked(), SUSPEND, "kube-1")
    meta = out["metadata"]
    assert meta["labels"] == {"team": "vision"}  # the queue label goes: no Kueue on the copy
    assert meta["annotations"] == {"owner": "ana", "muster.dev/job-id": "kube-1"}
    assert set(meta) == {"name", "namespace", "labels", "annotations"}  # no uid, finalizers
    assert out["spec"]["runPolicy"] == {}  # the copy must run
    spec = jobspec_from_manifest(out, queue="research")  # what the broker derives
    assert spec.job_id == "kube-1"
    assert [(p.name, p.replicas, p.gpu) for p in spec.gang] == [("master", 1, 2), ("worker", 2, 2)]


def test_every_watched_kind_but_volcano_can_be_suspended() -> None:
    unsuspendable = {a.resource.kind for a in WATCHED if suspend_of(a.resource).path is None}
    assert unsuspendable == {"Job"} and all(
        a.resource.api_version.startswith("batch.volcano.sh")
        for a in WATCHED
        if suspend_of(a.resource).path is None
    )
    assert "Pod" not in {a.resource.kind for a in WATCHED}


def test_the_verdicts_say_where_and_from_which_step() -> None:
    v = verdict_of("running", "west", "a100-spot", 2, 150, "")
    assert v.status == "True" and v.reason == "Running" and v.cluster == "west"
    assert (
        v.message == "running on cluster west (flavor a100-spot), attempt 2, resuming from step 150"
    )
    q = verdict_of("queued", None, None, 0, None, "no pool has 82 GPUs free")
    assert (q.status, q.reason, q.message) == ("False", "Queued", "no pool has 82 GPUs free")
    p = verdict_of("preempting", "west", None, 1, None, "spot-notice")
    assert p.message == "moving off cluster west: spot-notice"
    assert verdict_of("failed", "west", None, 3, None, "exit 1").reason == "Failed"


def test_a_front_door_only_on_the_kube_backend() -> None:
    raw = {
        "cluster": "east",
        "backend": "fake",
        "fake": {},
        "frontdoor": {"namespaces": {"ml": {"queues": ["research"]}}},
    }
    with pytest.raises(msgspec.ValidationError, match="only the kube backend"):
        msgspec.convert(raw, AgentConfig)
    with pytest.raises(msgspec.ValidationError, match="queues"):
        msgspec.convert({"namespaces": {"ml": {"queues": []}}}, FrontDoorConfig)


async def test_an_ended_job_is_never_run_again_after_a_restart(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    """The broker may have compacted an ended job: a restarted front door must not take its
    absence for a lost submission."""
    obj = marked()
    obj["metadata"]["annotations"] = {
        ANN_JOB: job_id_for(obj["metadata"]["uid"], "", True),
        ANN_SPEC: spec_hash(obj, SUSPEND, "research"),
        ANN_STATE: "Succeeded",
    }
    apiserver.put(f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs", obj)
    config = msgspec.convert({"namespaces": {NS: {"queues": ["research"]}}}, FrontDoorConfig)
    rest = KubeRest(api_client)
    door = FrontDoor("east", lambda: rest, config, Subjects())  # no NATS: any call would fail
    await door.sync()
    assert door.submits == 0 and door.tracked == {}
    assert [m for m, _, _ in apiserver.requests if m != "GET"] == []


def test_the_shipped_configmaps_frontdoor_example_parses() -> None:
    configmap = DEPLOY / "agent" / "configmap.yaml"
    text = yaml.safe_load(configmap.read_text())["data"]["agent.yaml"]
    assert "# frontdoor:" in text
    config = msgspec.convert(
        yaml.safe_load(text.replace("# frontdoor:", "frontdoor:").replace("#   ", "  ")),
        AgentConfig,
    )
    assert config.frontdoor is not None and "muster-workloads" in config.frontdoor.namespaces


async def test_an_agent_config_with_a_front_door_gets_one_beside_its_backend(nc: Any) -> None:
    raw = {
        "cluster": "east",
        "backend": "kube",
        "kube": {"namespace": NS},
        "frontdoor": {"namespaces": {NS: {"queues": ["research"]}}},
    }
    config = msgspec.convert(raw, AgentConfig)
    api = ApiClient()
    try:
        backend = KubeBackend("east", make_config(), api_client=api)
        runtime = _runtime(backend, nc, config, Subjects())
        assert isinstance(runtime.companion, FrontDoor)
        assert runtime.companion.config == config.frontdoor
        plain = _runtime(backend, nc, msgspec.structs.replace(config, frontdoor=None), Subjects())
        assert plain.companion is None
    finally:
        await api.close()


async def test_the_stand_in_writes_only_status_through_the_status_subresource(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    collection = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
    apiserver.put(collection, marked())
    rest = KubeRest(api_client)
    body = {"metadata": {"labels": {"sneaked": "in"}}, "status": {"conditions": []}}
    await rest.request("PATCH", f"{collection}/ddp/status", body=body, content_type=MERGE_PATCH)
    stored = apiserver.get(f"{collection}/ddp")
    assert stored is not None
    assert stored["status"] == {"conditions": []}
    assert "sneaked" not in stored["metadata"]["labels"]


async def test_the_stand_in_refuses_a_patch_on_a_stale_resource_version(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    collection = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
    stored = apiserver.put(collection, marked())
    rest = KubeRest(api_client)
    fresh = stored["metadata"]["resourceVersion"]
    await rest.request(
        "PATCH",
        f"{collection}/ddp",
        body={"metadata": {"resourceVersion": fresh, "annotations": {"a": "1"}}},
        content_type=MERGE_PATCH,
    )
    with pytest.raises(KubeApiError) as refused:
        await rest.request(
            "PATCH",
            f"{collection}/ddp",
            body={"metadata": {"resourceVersion": fresh, "annotations": {"a": "2"}}},
            content_type=MERGE_PATCH,
        )
    assert refused.value.status == 409 and refused.value.detail.reason == "Conflict"
    after = apiserver.get(f"{collection}/ddp")
    assert after is not None and after["metadata"]["annotations"]["a"] == "1"


async def test_an_edit_waits_for_the_old_job_to_be_cancelled(
    apiserver: FakeApiServer, api_client: ApiClient, nc: Any
) -> None:
    """No broker answers the cancel: nothing new is submitted, the object keeps its job, and
    a later pass tries again (one object never has two jobs)."""
    obj = marked()
    old_id = job_id_for(obj["metadata"]["uid"], "", True)
    obj["metadata"]["annotations"] = {ANN_JOB: old_id, ANN_SPEC: "spec-before-the-edit"}
    collection = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
    apiserver.put(collection, obj)
    config = msgspec.convert(
        {"namespaces": {NS: {"queues": ["research"]}}, "request_timeout_s": 0.2},
        FrontDoorConfig,
    )
    rest = KubeRest(api_client)
    door = FrontDoor("east", lambda: rest, config, Subjects(prefix="nobody-answers"))
    door.nc = nc
    await door.sync()
    await door.sync()
    assert door.submits == 0
    stored = apiserver.get(f"{collection}/ddp")
    assert stored is not None and stored["metadata"]["annotations"][ANN_JOB] == old_id


@pytest.mark.parametrize("example", ["jobset.yaml", "trainjob.yaml", "pytorchjob.yaml"])
async def test_the_condition_passes_each_kinds_status_schema_and_keeps_the_operators(
    apiserver: FakeApiServer, api_client: ApiClient, example: str
) -> None:
    """metav1.Condition (JobSet, TrainJob) takes no fields beyond its own; the Kubeflow
    JobCondition differs. The stand-in validates the status write against each CRD."""
    obj = yaml.safe_load((EXAMPLE.parent / example).read_text())
    obj["metadata"]["namespace"] = NS
    resource = next(a.resource for a in WATCHED if a.handles(obj["apiVersion"], obj["kind"]))
    operator = {
        "type": "Suspended",
        "status": "True",
        "reason": "Suspended",
        "message": "by the operator",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    obj["status"] = {"conditions": [operator]}
    apiserver.put(resource.collection(NS), obj)
    rest = KubeRest(api_client)
    config = msgspec.convert({"namespaces": {NS: {"queues": ["research"]}}}, FrontDoorConfig)
    door = FrontDoor("east", lambda: rest, config, Subjects())
    path = f"{resource.collection(NS)}/{obj['metadata']['name']}"
    running = verdict_of("running", "west", "a100-spot", 1, None, "")
    await door.write_condition(path, running)
    await door.write_condition(path, verdict_of("running", "east", "a100-spot", 2, 120, ""))
    stored = apiserver.get(path)
    assert stored is not None and not apiserver.rejected
    conditions = {c["type"]: c for c in stored["status"]["conditions"]}
    assert conditions["Suspended"] == operator
    ours = conditions["MusterAdmitted"]
    assert (ours["status"], ours["reason"]) == ("True", "Running")
    assert ours["message"].endswith("resuming from step 120")
