"""A Dispatch revision of a running elastic attempt on the kube backend: the workload object
is merge-patched to the new replica count (PyTorchJob Worker replicas, Job parallelism, Volcano
task replicas), validated by the stand-in API server against the real schema and shipped RBAC;
a kind that cannot resize answers with a typed reason and the object is left as it was."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from nats.aio.client import Client

from agents.backend import CannotResize
from agents.kube.backend import KubeBackend
from agents.runtime import AgentRuntime
from kinds.batch import COMPLETIONS_EQUAL_ANN
from schemas.agent import CommandAck
from tests.kube.conftest import NOW, Recorder, make_config
from tests.kube.elastic import elastic_dispatch, elastic_job, elastic_volcano, load_fixture
from tests.kube.fake_apiserver import FakeApiServer

NS = "muster-workloads"


def _stored(apiserver: FakeApiServer, path: str) -> dict[str, Any]:
    (obj,) = [o for o in apiserver.items(*path.rsplit("/", 1)) if o["metadata"]["name"] == "j-1-a1"]
    return obj


async def _resize(
    make_backend: Any,
    apiserver: FakeApiServer,
    manifest: dict[str, Any],
    before: dict[str, int],
    after: dict[str, int],
    resource: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(manifest, before))
    was = copy.deepcopy(_stored(apiserver, resource))
    await b.resize(elastic_dispatch(manifest, after, revision=1))
    return was, _stored(apiserver, resource)


def _pins(template: dict[str, Any]) -> set[str]:
    terms = template["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    return {f["values"][0] for t in terms for f in t["matchFields"] if f["key"] == "metadata.name"}


@pytest.mark.parametrize(("start", "end"), [(4, 3), (3, 4)])
async def test_an_elastic_pytorchjob_takes_its_new_worker_count_and_nodes(
    make_backend: Any, apiserver: FakeApiServer, start: int, end: int
) -> None:
    manifest = load_fixture("pytorchjob-elastic-spot.yaml")
    was, now = await _resize(
        make_backend, apiserver, manifest, {"worker": start}, {"worker": end},
        "kubeflow.org/v1/pytorchjobs",
    )  # fmt: skip
    worker = now["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert was["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == start
    assert worker["replicas"] == end
    assert _pins(worker["template"]) == {f"worker-n{i}" for i in range(end)}
    assert now["spec"]["elasticPolicy"] == was["spec"]["elasticPolicy"]
    (patch,) = [p for p in apiserver.patches if p[0].endswith("/pytorchjobs/j-1-a1")]
    assert patch[1] == "application/merge-patch+json"
    assert set(patch[2]["spec"]) == {"pytorchReplicaSpecs"}  # nothing else is touched


async def test_an_elastic_job_shrinks_its_parallelism(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    manifest = elastic_job()
    was, now = await _resize(
        make_backend, apiserver, manifest, {"worker": 4}, {"worker": 3}, "batch/v1/jobs"
    )
    assert (was["spec"]["parallelism"], now["spec"]["parallelism"]) == (4, 3)
    assert now["spec"]["template"] == was["spec"]["template"]  # immutable, untouched


async def test_an_elastic_indexed_job_changes_completions_with_parallelism(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    """One index per worker: an Indexed Job whose completions equal its parallelism keeps
    them equal (KEP-3715), else a shrunk gang would leave an index waiting for a free slot.
    It shrinks to 3, then grows back to 4 on the nodes its template was pinned to."""
    manifest = elastic_job()
    manifest["spec"]["completionMode"] = "Indexed"
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(manifest, {"worker": 4}))
    for revision, count in ((1, 3), (2, 4)):
        await b.resize(elastic_dispatch(manifest, {"worker": count}, revision=revision))
        (job,) = apiserver.items("batch/v1", "jobs")
        assert (job["spec"]["parallelism"], job["spec"]["completions"]) == (count, count)
    assert apiserver.rejected == []


async def test_a_non_indexed_job_whose_completions_follow_its_admission_cannot_resize(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    """Kueue's completions-equal-parallelism set completions at admission; they are
    immutable on a Job that is not Indexed, so a resize would leave the count wrong."""
    manifest = elastic_job()
    manifest["metadata"]["annotations"][COMPLETIONS_EQUAL_ANN] = "true"
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(manifest, {"worker": 4}))
    with pytest.raises(CannotResize, match=r"spec\.completions: 4 cannot change while the Job"):
        await b.resize(elastic_dispatch(manifest, {"worker": 3}, revision=1))
    (job,) = apiserver.items("batch/v1", "jobs")
    assert (job["spec"]["parallelism"], job["spec"]["completions"]) == (4, 4)


async def test_a_job_cannot_grow_onto_nodes_its_immutable_template_does_not_pin(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    manifest = elastic_job()
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(manifest, {"worker": 3}))
    with pytest.raises(CannotResize, match=r"pinned to the nodes it started on .* worker-n3"):
        await b.resize(elastic_dispatch(manifest, {"worker": 4}, revision=1))
    assert _stored(apiserver, "batch/v1/jobs")["spec"]["parallelism"] == 3


async def test_a_volcano_job_scales_its_elastic_task(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    manifest = elastic_volcano()
    was, now = await _resize(
        make_backend, apiserver, manifest, {"master": 1, "worker": 3}, {"master": 1, "worker": 2},
        "batch.volcano.sh/v1alpha1/jobs",
    )  # fmt: skip
    replicas = {t["name"]: t["replicas"] for t in now["spec"]["tasks"]}
    assert replicas == {"master": 1, "worker": 2}
    assert [t["template"] for t in now["spec"]["tasks"]] == [
        t["template"] for t in was["spec"]["tasks"]
    ]
    assert now["spec"]["minAvailable"] == 3


async def test_a_kind_that_cannot_resize_says_why_and_is_left_alone(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    """A RayJob's workers live in the RayCluster KubeRay made from it (tests/kube/
    test_ray_resize.py): before KubeRay names it, nothing can be patched."""
    root = Path(__file__).parents[2]
    ray = yaml.safe_load((root / "examples" / "jobs" / "rayjob.yaml").read_text(encoding="utf-8"))
    (group,) = ray["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    group.update(minReplicas=1, maxReplicas=6)
    ray["metadata"]["annotations"] = {"kueue.x-k8s.io/elastic-job": "true"}
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(ray, {"head": 1, "gpu-workers": 3}))
    before = copy.deepcopy(_stored(apiserver, "ray.io/v1/rayjobs"))
    with pytest.raises(CannotResize, match="RayJob j-1-a1: KubeRay has not named the RayCluster"):
        await b.resize(elastic_dispatch(ray, {"head": 1, "gpu-workers": 2}, revision=1))
    assert _stored(apiserver, "ray.io/v1/rayjobs") == before
    assert not [p for p in apiserver.patches if "/ray" in p[0]]


def test_a_revision_changes_nothing_but_the_replica_fields() -> None:
    """The merge patch of a PyTorchJob names only the replica types whose count changed."""
    from kinds.kubeflow import ADAPTERS

    pt = next(a for a in ADAPTERS if a.resource.kind == "PyTorchJob")
    live = load_fixture("pytorchjob-elastic-spot.yaml")
    new = msgspec.json.decode(msgspec.json.encode(live))
    new["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 5
    patch = pt.resize_patch(live, new)
    assert list(patch["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert patch["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 5
    del live["spec"]["elasticPolicy"]
    with pytest.raises(ValueError, match=r"without spec\.elasticPolicy"):
        pt.resize_patch(live, new)


async def test_an_adopted_elastic_pytorchjob_takes_a_resize_after_the_agent_restarts(
    make_backend: Any, apiserver: FakeApiServer, api_client: Any, nc: Client
) -> None:
    """The agent that created the attempt is gone; the next one finds the PyTorchJob, learns
    it from its snapshot (as at startup), and takes the broker's revision as a resize of the
    object that exists, not as a new attempt whose existing object would be adopted as is."""
    manifest = load_fixture("pytorchjob-elastic-spot.yaml")
    first = KubeBackend("c1", make_config(), api_client=api_client, clock=lambda: NOW)
    await first.start(Recorder())
    await first.dispatch(elastic_dispatch(manifest, {"worker": 4}))
    await first.stop()
    backend, _ = await make_backend()
    runtime = AgentRuntime(backend, nc)
    runtime.adopt(await backend.snapshot())
    assert runtime.live_attempts("j-1") == {1}
    ack = await runtime.carry_out(elastic_dispatch(manifest, {"worker": 3}, revision=1))
    assert ack == CommandAck(ok=True)
    (job,) = apiserver.items("kubeflow.org/v1", "pytorchjobs")
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 3
    assert _pins(worker["template"]) == {f"worker-n{i}" for i in range(3)}
    creates = [p for m, p, _ in apiserver.requests if m == "POST" and p.endswith("/pytorchjobs")]
    assert len(creates) == 1  # the first agent's; nothing created again
