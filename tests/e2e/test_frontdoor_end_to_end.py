"""The Kubernetes front door end to end: a PyTorchJob applied in cluster east (the home
cluster, whose GPU nodes are cordoned at first) with a queue label runs in cluster west; the
home object shows it. Real broker, real agent runtimes with `KubeBackend`, real nats-server,
one strict stand-in API server per cluster; the user's writes go through the HTTP API as
`kubectl apply` / `kubectl delete` would send them."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio.client import ApiClient

from agents.config import FrontDoorConfig
from agents.kube.backend import KubeBackend
from agents.kube.client import KubeRest
from agents.kube.frontdoor import (
    ANN_CLUSTER,
    ANN_JOB,
    ANN_SPEC,
    ANN_STATE,
    CONDITION,
    FINALIZER,
    FrontDoor,
    spec_hash,
)
from agents.kube.rbac import CLUSTER_RULES, NAMESPACE_RULES, Rule, frontdoor_rules
from agents.runtime import AgentRuntime
from schemas.config import QueueConfig
from schemas.subjects import Subjects
from tests.e2e.conftest import kube_clusters
from tests.e2e.kinds_world import KubeCluster
from tests.kube.conftest import NODES, NS, make_config, node
from tests.kube.fake_apiserver import FakeApiServer, parse_path
from tests.world import World

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "pytorchjob.yaml"
PYTORCHJOBS = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
VCJOBS = f"/apis/batch.volcano.sh/v1alpha1/namespaces/{NS}/jobs"
EVENTS = f"/api/v1/namespaces/{NS}/events"
SPOT_TAINT = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}
# The namespace may use `default` and `nosuch` (which the broker does not have); not `research`.
DOOR_CONFIG = msgspec.convert(
    {"namespaces": {NS: {"queues": ["default", "nosuch"]}}, "poll_s": 0.1}, FrontDoorConfig
)


def home_job(name: str, queue: str = "default", suspend: bool = True) -> dict[str, Any]:
    """The example PyTorchJob as a user would mark it for Muster."""
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"] = {
        "name": name,
        "namespace": NS,
        "labels": {"kueue.x-k8s.io/queue-name": queue},
        # it checkpoints, so spot (both clusters here) may take it
        "annotations": {"muster.dev/checkpoint-uri": "s3://ckpt"},
    }
    job["spec"]["runPolicy"] = {"suspend": suspend}
    return dict(job)


def gpu_nodes(name: str) -> list[dict[str, Any]]:
    labels = {"karpenter.sh/capacity-type": "spot"}
    return [
        node(f"{name}-n{i}", labels={**labels, "kubernetes.io/hostname": f"{name}-n{i}"})
        for i in range(2)
    ]


@pytest_asyncio.fixture
async def fd_world(
    world: World, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[World, dict[str, KubeCluster], FrontDoor, KubeRest]]:
    """East (no GPUs at first) runs the front door; with a team as the param, queue
    `default` belongs to that team and the namespace's front door acts as it."""
    h = world.harness
    team: str | None = getattr(request, "param", None)
    door_config = DOOR_CONFIG
    if team is not None:
        queues = [QueueConfig(name="default", team=team), QueueConfig(name="research")]
        h.config = msgspec.structs.replace(h.config, queues=queues)
        door_config = msgspec.convert(
            {"namespaces": {NS: {"queues": ["default"], "team": team}}, "poll_s": 0.1},
            FrontDoorConfig,
        )

    def first_nodes(name: str) -> list[dict[str, Any]]:
        return [] if name == "east" else gpu_nodes(name)  # east starts with no GPUs

    doors: dict[str, FrontDoor] = {}

    def build(name: str, server: FakeApiServer, api: ApiClient) -> KubeCluster:
        backend = KubeBackend(name, make_config(), api_client=api)
        door = None
        if name == "east":
            door = doors[name] = FrontDoor(name, lambda: backend.rest, door_config, h.subjects)
        runtime = AgentRuntime(backend, h.nc, subjects=h.subjects, heartbeat_s=0.2, companion=door)
        return KubeCluster(name, server, api, runtime)

    async with kube_clusters(world, first_nodes, build) as clusters:
        yield world, clusters, doors["east"], KubeRest(clusters["east"].api)


def door_after_restart(door: FrontDoor, subjects: Subjects) -> FrontDoor:
    """A new front door of the same agent (the backend's REST client), nothing in memory."""
    rest = door.rest
    return FrontDoor(door.cluster, lambda: rest, DOOR_CONFIG, subjects)


def condition(obj: dict[str, Any] | None) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == CONDITION:
            return dict(c)
    return {}


def events_for(server: FakeApiServer, name: str) -> list[tuple[str, str]]:
    return [
        (e["reason"], e["message"])
        for e in server.items("v1", "events")
        if e["involvedObject"]["name"] == name
    ]


async def apply(rest: KubeRest, collection: str, body: dict[str, Any]) -> dict[str, Any]:
    """`kubectl apply`: create, or merge the manifest into the existing object."""
    created = await rest.create(collection, body)
    if created is not None:
        return created
    path = f"{collection}/{body['metadata']['name']}"
    await rest.request("PATCH", path, body=body, content_type="application/merge-patch+json")
    return json.loads(await rest.request("GET", path) or b"{}")  # type: ignore[no-any-return]


async def test_a_pytorchjob_applied_in_east_runs_in_west_and_the_home_object_shows_it(
    fd_world: tuple[World, dict[str, KubeCluster], FrontDoor, KubeRest],
) -> None:
    world, clusters, door, rest = fd_world
    h = world.harness
    east, west = clusters["east"], clusters["west"]
    created = await apply(rest, PYTORCHJOBS, home_job("ddp"))
    job_id = f"kube-{created['metadata']['uid']}"
    path = f"{PYTORCHJOBS}/ddp"

    running = await h.wait_event(job_id, "running", timeout=20)
    assert running.cluster == "west"
    assert [o["metadata"]["labels"]["muster.dev/job-id"] for _, o in west.workloads()] == [job_id]
    assert east.workloads() == []

    def shows(reason: str, text: str) -> bool:
        c = condition(east.server.get(path))
        return c.get("reason") == reason and text in c.get("message", "")

    await h.wait_for(lambda: shows("Running", "running on cluster west"), 10)
    home = east.server.get(path)
    assert home is not None
    assert condition(home)["status"] == "True"
    assert home["metadata"]["annotations"][ANN_JOB] == job_id
    assert home["metadata"]["annotations"][ANN_CLUSTER] == "west"
    assert FINALIZER in home["metadata"]["finalizers"]
    assert home["spec"]["runPolicy"]["suspend"] is True, "the home object must stay suspended"
    # The Event follows the condition in a write of its own.
    await h.wait_for(lambda: "Running" in [r for r, _ in events_for(east.server, "ddp")], 10)
    assert "Submitted" in [r for r, _ in events_for(east.server, "ddp")]

    # Re-applying the same manifest (GitOps sync) submits nothing.
    await apply(rest, PYTORCHJOBS, home_job("ddp"))
    await door.sync()
    assert door.submits == 1

    # The agent restarts: a new front door (nothing kept in memory) finds the job by the
    # object's annotations.
    await door.stop()
    restarted = door_after_restart(door, h.subjects)
    east.runtime.companion = restarted
    await restarted.start(h.nc)
    await restarted.sync()
    assert restarted.submits == 0
    jobs = (await h.api("list"))["result"]
    assert [j["job_id"] for j in jobs] == [job_id]
    door = restarted

    # East gets GPU nodes; a spot notice in west moves the job there, and the home object
    # shows the move and the step it resumes from.
    west.write_checkpoint(job_id, 120)
    await h.wait_event(job_id, "checkpointed")
    for n in gpu_nodes("east"):
        east.server.put(NODES, n)
    for n in west.server.items("v1", "nodes"):
        tainted = copy.deepcopy(n)
        tainted["spec"]["taints"] = [SPOT_TAINT]
        west.server.put(NODES, tainted)
    await h.wait_event(job_id, "preempting")
    west.write_checkpoint(job_id, 130)  # the SDK answers the notice's checkpoint request
    moved = await h.wait_event(job_id, "admitted", count=2, timeout=20)
    assert moved.cluster == "east" and moved.resume_from_step == 130
    second = await h.wait_event(job_id, "running", count=2, timeout=20)
    assert second.cluster == "east"
    await h.wait_for(lambda: shows("Running", "on cluster east"), 10)
    assert "resuming from step 130" in condition(east.server.get(path))["message"]
    reasons = [r for r, _ in events_for(east.server, "ddp")]
    assert "Preempting" in reasons
    # Placed in the home cluster, the job runs as a copy; the user's object stays suspended.
    copies = [o for _, o in east.workloads()]
    assert len(copies) == 1 and copies[0]["metadata"]["name"] != "ddp"
    assert copies[0]["metadata"]["annotations"]["muster.dev/original-name"] == "ddp"
    assert "runPolicy" not in copies[0]["spec"] or not copies[0]["spec"]["runPolicy"].get("suspend")
    assert (east.server.get(path) or {})["spec"]["runPolicy"]["suspend"] is True

    # `kubectl delete` cancels the job everywhere, then the object goes.
    await rest.request("DELETE", path)
    await h.wait_event(job_id, "cancelled", timeout=10)
    await h.wait_for(lambda: east.server.get(path) is None and not east.workloads(), 10)
    assert door.submits == 0
    assert not east.server.rejected and not west.server.rejected
    granted = CLUSTER_RULES | NAMESPACE_RULES | frontdoor_rules()
    assert {rule_of(m, p, q) for m, p, q in east.server.requests} - granted == set()


def rule_of(method: str, path: str, query: dict[str, str]) -> Rule:
    """The RBAC rule a request needs."""
    route = parse_path(path)
    assert route is not None, path
    resource = route.res[1] + (f"/{route.subresource}" if route.subresource else "")
    if method == "GET":
        verb = "get" if route.name else "watch" if query.get("watch") == "true" else "list"
    else:
        verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}[method]
    return Rule(route.group, resource, verb)


async def test_a_restart_between_marking_and_submitting_submits_once(
    fd_world: tuple[World, dict[str, KubeCluster], FrontDoor, KubeRest],
) -> None:
    """The agent wrote the job id on the object, then died before publishing: the next one
    submits under that id, once."""
    world, _, door, rest = fd_world
    h = world.harness
    await door.stop()  # nothing runs the front door while the object is created
    created = await apply(rest, PYTORCHJOBS, home_job("half"))
    job_id = f"kube-{created['metadata']['uid']}"
    path = f"{PYTORCHJOBS}/half"
    # What the lost pass wrote before publishing: the id, the spec it runs, the finalizer.
    digest = spec_hash(created, ("spec", "runPolicy", "suspend"), "default")
    marks = {ANN_JOB: job_id, ANN_SPEC: digest}
    patch = {"metadata": {"annotations": marks, "finalizers": [FINALIZER]}}
    await rest.request("PATCH", path, body=patch, content_type="application/merge-patch+json")
    fresh = door_after_restart(door, h.subjects)
    await fresh.start(h.nc)
    try:
        await h.wait_event(job_id, "running", timeout=20)
        await fresh.sync()
        await fresh.sync()
        assert fresh.submits == 1
        assert [j["job_id"] for j in (await h.api("list"))["result"]] == [job_id]
    finally:
        await fresh.stop()


async def test_bad_input_gets_a_condition_and_an_event_and_nothing_else(
    fd_world: tuple[World, dict[str, KubeCluster], FrontDoor, KubeRest],
) -> None:
    world, clusters, door, rest = fd_world
    h = world.harness
    east = clusters["east"]
    await apply(rest, PYTORCHJOBS, home_job("other-team", queue="research"))
    await apply(rest, PYTORCHJOBS, home_job("no-such-queue", queue="nosuch"))
    await apply(rest, PYTORCHJOBS, home_job("running-already", suspend=False))
    empty = home_job("no-pods")
    for replica_spec in empty["spec"]["pytorchReplicaSpecs"].values():
        replica_spec["replicas"] = 0
    await apply(rest, PYTORCHJOBS, empty)
    vcjob = {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "volcano", "namespace": NS, "labels": {"muster.dev/queue": "default"}},
        "spec": {
            "minAvailable": 1,
            "tasks": [
                {
                    "name": "worker",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [{"name": "w", "image": "trainer:1"}],
                        }
                    },
                }
            ],
        },
    }
    await apply(rest, VCJOBS, vcjob)
    expected = {
        (PYTORCHJOBS, "other-team"): ("QueueNotAllowed", "may not use queue 'research'"),
        (PYTORCHJOBS, "no-such-queue"): ("Rejected", "unknown queue 'nosuch'"),
        (PYTORCHJOBS, "running-already"): ("NotSuspended", "runPolicy.suspend: true"),
        (PYTORCHJOBS, "no-pods"): ("InvalidJob", "asks for no pods"),
        (VCJOBS, "volcano"): ("UnsupportedKind", "has no suspend field"),
    }

    def state(collection: str, name: str) -> str:
        obj = east.server.get(f"{collection}/{name}") or {}
        return str((obj.get("metadata", {}).get("annotations") or {}).get(ANN_STATE, ""))

    def settled(collection: str, name: str, reason: str) -> bool:
        """The annotation, the Event and, on a Kubeflow job, the condition (each its own
        write to the API server, in no promised order)."""
        if state(collection, name) != reason:
            return False
        if not any(r == reason for r, _ in events_for(east.server, name)):
            return False
        obj = east.server.get(f"{collection}/{name}") or {}
        return collection != PYTORCHJOBS or "status" in condition(obj)

    await h.wait_for(lambda: all(settled(c, n, r) for (c, n), (r, _) in expected.items()), 10)
    for (collection, name), (reason, text) in expected.items():
        obj = east.server.get(f"{collection}/{name}")
        assert obj is not None
        if collection == PYTORCHJOBS:
            c = condition(obj)
            assert (c["status"], c["reason"]) == ("False", reason) and text in c["message"], c
        assert [(r, m) for r, m in events_for(east.server, name) if r == reason], name
        assert FINALIZER not in (obj["metadata"].get("finalizers") or []), name
    # Nothing else: no job in the broker, nothing created anywhere, and no repeats.
    await door.sync()
    await door.sync()
    assert (await h.api("list"))["result"] == []
    assert not east.workloads() and not clusters["west"].workloads()
    assert len(events_for(east.server, "other-team")) == 1
    assert door.submits == 2  # the two the broker refused


async def test_a_queued_job_shows_why_and_an_edit_is_a_resubmission(
    fd_world: tuple[World, dict[str, KubeCluster], FrontDoor, KubeRest],
) -> None:
    """Too big for the fleet: the condition says Queued and why. Editing the spec cancels
    that job and submits the new spec under a new id, which runs; the old id is gone."""
    world, clusters, door, rest = fd_world
    h = world.harness
    east = clusters["east"]
    big = home_job("edit")
    big["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 40  # 82 GPUs; west has 16
    created = await apply(rest, PYTORCHJOBS, big)
    first = f"kube-{created['metadata']['uid']}"
    path = f"{PYTORCHJOBS}/edit"
    await h.wait_event(first, "queued", timeout=10)

    def shown() -> dict[str, Any]:
        return condition(east.server.get(path))

    await h.wait_for(lambda: shown().get("reason") == "Queued", 10)
    assert shown()["status"] == "False" and "GPU" in shown()["message"], shown()

    await apply(rest, PYTORCHJOBS, home_job("edit"))  # back to 2 workers: an edit
    await h.wait_event(first, "cancelled", timeout=10)

    def job_on_object() -> str:
        return str(((east.server.get(path) or {})["metadata"].get("annotations") or {})[ANN_JOB])

    await h.wait_for(lambda: job_on_object() != first, 10)
    second = job_on_object()
    assert second.startswith(first + "-")
    running = await h.wait_event(second, "running", timeout=20)
    assert running.cluster == "west"
    await h.wait_for(lambda: shown().get("reason") == "Running", 10)
    jobs = {j["job_id"]: j["state"] for j in (await h.api("list"))["result"]}
    assert jobs == {first: "cancelled", second: "running"}
    assert door.submits == 2


@pytest.mark.parametrize("fd_world", ["ml"], indirect=True)
async def test_a_team_namespace_submits_and_follows_as_its_team(
    fd_world: tuple[World, dict[str, KubeCluster], FrontDoor, KubeRest],
) -> None:
    """The front door asks, hears and cancels on the team's own subjects (the ones
    `muster nats-config --frontdoor` lets it use)."""
    world, clusters, _, rest = fd_world
    h = world.harness
    east = clusters["east"]
    asked: list[str] = []

    async def record(msg: Any) -> None:
        asked.append(msg.subject.rsplit(".", 1)[1])

    await h.nc.subscribe(f"{h.prefix}.api.ml.*", cb=record)
    created = await apply(rest, PYTORCHJOBS, home_job("teamjob"))
    job_id = f"kube-{created['metadata']['uid']}"
    path = f"{PYTORCHJOBS}/teamjob"
    await h.wait_event(job_id, "running", timeout=20)
    await h.wait_for(lambda: condition(east.server.get(path)).get("reason") == "Running", 10)
    await rest.request("DELETE", path)
    await h.wait_event(job_id, "cancelled", timeout=10)
    await h.wait_for(lambda: east.server.get(path) is None, 10)
    assert {"get", "cancel"} <= set(asked)


async def test_a_batch_job_shows_where_it_runs_in_annotations_and_is_cancelled_on_delete(
    fd_world: tuple[World, dict[str, KubeCluster], FrontDoor, KubeRest],
) -> None:
    """A batch/v1 Job's conditions belong to the Job controller: the annotations say it."""
    world, clusters, _, rest = fd_world
    h = world.harness
    east = clusters["east"]
    job = yaml.safe_load((EXAMPLE.parent / "indexed-job.yaml").read_text())
    job["metadata"] = {
        "name": "sweep",
        "namespace": NS,
        # it writes no checkpoint; spot (both clusters here) is fine for it
        "labels": {"muster.dev/queue": "default", "muster.dev/spot-ok": "true"},
    }
    job["spec"]["suspend"] = True
    collection = f"/apis/batch/v1/namespaces/{NS}/jobs"
    created = await apply(rest, collection, job)
    job_id = f"kube-{created['metadata']['uid']}"
    path = f"{collection}/sweep"
    running = await h.wait_event(job_id, "running", timeout=20)
    assert running.cluster == "west"

    def annotations() -> dict[str, str]:
        return dict(((east.server.get(path) or {})["metadata"].get("annotations")) or {})

    await h.wait_for(lambda: annotations().get(ANN_STATE) == "Running", 10)
    assert annotations()[ANN_CLUSTER] == "west"
    home = east.server.get(path)
    assert home is not None and home["spec"]["suspend"] is True
    assert condition(home) == {}  # nothing written into the Job controller's conditions
    assert [r for r, _ in events_for(east.server, "sweep")][:1] == ["Submitted"]
    await rest.request("DELETE", path)
    await h.wait_event(job_id, "cancelled", timeout=10)
    await h.wait_for(lambda: east.server.get(path) is None, 10)
    assert not east.server.rejected and not clusters["west"].server.rejected
