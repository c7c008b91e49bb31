"""An elastic RayJob resized in place: its worker group's `replicas` change in the RayCluster
KubeRay made from it (named in the RayJob's `status.rayClusterName`), by a JSON patch on the
group's index, within the group's bounds and the shipped RBAC. The stand-in API server runs a
model of KubeRay (tests/kube/kuberay_model.py) that creates that RayCluster and scales its
pods, validates the RayCluster against KubeRay's CRD, and enforces deploy/agent's RBAC."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.backend import CannotResize
from kinds.base import ResizeRefused
from kinds.ray import group_ops
from tests.kube.elastic import EXAMPLES, elastic_dispatch, elastic_rayjob
from tests.kube.fake_apiserver import FakeApiServer, json_patch
from tests.kube.kuberay_model import KubeRay
from tests.kube.rbac_authz import RbacAuthorizer
from tests.support import wait_for

NS = "muster-workloads"
GROUP = "gpu-workers"


def _counts(workers: int) -> dict[str, int]:
    return {"head": 1, GROUP: workers}


def _cluster(apiserver: FakeApiServer) -> dict[str, Any]:
    """The one RayCluster: a RayJob's (the one its status names) or a bare one."""
    (cluster,) = apiserver.items("ray.io/v1", "rayclusters")
    for job in apiserver.items("ray.io/v1", "rayjobs"):
        assert cluster["metadata"]["name"] == job["status"]["rayClusterName"]
    return cluster  # type: ignore[no-any-return]


def _group(apiserver: FakeApiServer) -> dict[str, Any]:
    (group,) = _cluster(apiserver)["spec"]["workerGroupSpecs"]
    return group  # type: ignore[no-any-return]


def _pins(template: dict[str, Any]) -> set[str]:
    terms = template["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    return {f["values"][0] for t in terms for f in t["matchFields"] if f["key"] == "metadata.name"}


def _workers(apiserver: FakeApiServer) -> list[dict[str, Any]]:
    return [
        p
        for p in apiserver.items("v1", "pods")
        if p["metadata"]["labels"].get("ray.io/group") == GROUP
        and not p["metadata"].get("deletionTimestamp")
    ]


def _bind(apiserver: FakeApiServer) -> None:
    """What the scheduler does: each unbound worker to a free node its template admits."""
    pods = _workers(apiserver)
    taken = {p["spec"].get("nodeName") for p in pods}
    for pod in pods:
        if pod["spec"].get("nodeName"):
            continue
        node = min(n for n in _pins({"spec": pod["spec"]}) if n not in taken)
        taken.add(node)
        bound = copy.deepcopy(pod)
        bound["spec"]["nodeName"] = node
        bound["status"] = {"phase": "Running"}
        apiserver.put(f"/api/v1/namespaces/{NS}/pods", bound)


async def _running(make_backend: Any, apiserver: FakeApiServer, workers: int) -> Any:
    """The elastic RayJob dispatched with `workers` workers, its pods bound and seen."""
    apiserver.kuberay = KubeRay(seed=11)
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(elastic_rayjob(), _counts(workers)))
    apiserver.kuberay.reconcile(apiserver)
    _bind(apiserver)
    await wait_for(lambda: len(b.attempts.pod_names.get(("j-1", 1), {})) == workers)
    return b


async def test_a_rayjob_grows_in_the_raycluster_kuberay_made_for_it(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    b = await _running(make_backend, apiserver, 3)
    (job_before,) = copy.deepcopy(apiserver.items("ray.io/v1", "rayjobs"))
    await b.resize(elastic_dispatch(elastic_rayjob(), _counts(5), revision=1))
    group = _group(apiserver)
    assert group["replicas"] == 5
    assert _pins(group["template"]) == {f"{GROUP}-n{i}" for i in range(5)}
    (job_after,) = apiserver.items("ray.io/v1", "rayjobs")
    assert job_after["spec"] == job_before["spec"]  # KubeRay disregards the RayJob's copy
    (patch,) = [p for p in apiserver.patches if "/rayclusters/" in p[0]]
    assert patch[1] == "application/json-patch+json"
    assert patch[2][0] == {
        "op": "test",
        "path": "/spec/workerGroupSpecs/0/groupName",
        "value": GROUP,
    }
    assert apiserver.kuberay is not None
    apiserver.kuberay.reconcile(apiserver)
    assert len(_workers(apiserver)) == 5


async def test_a_rayjob_shrinks_and_kuberay_deletes_the_pod_on_the_dropped_node(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    """Without `workersToDelete` KubeRay would delete whichever pods it lists first."""
    b = await _running(make_backend, apiserver, 4)
    gone = next(p for p in _workers(apiserver) if p["spec"]["nodeName"] == f"{GROUP}-n3")
    await b.resize(elastic_dispatch(elastic_rayjob(), _counts(3), revision=1))
    group = _group(apiserver)
    assert group["replicas"] == 3
    assert group["scaleStrategy"]["workersToDelete"] == [gone["metadata"]["name"]]
    assert apiserver.kuberay is not None
    apiserver.kuberay.reconcile(apiserver)
    left = {p["spec"]["nodeName"] for p in _workers(apiserver)}
    assert left == {f"{GROUP}-n{i}" for i in range(3)}
    assert _group(apiserver)["scaleStrategy"]["workersToDelete"] == []


async def test_a_count_outside_the_groups_bounds_is_refused_before_any_patch(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    """KubeRay would run the group clamped to [minReplicas, maxReplicas] without a word."""
    b = await _running(make_backend, apiserver, 3)
    with pytest.raises(CannotResize, match=r"between its minReplicas 1 and maxReplicas 6, so it"):
        await b.resize(elastic_dispatch(elastic_rayjob(high=8), _counts(7), revision=1))
    assert _group(apiserver)["replicas"] == 3
    assert not [p for p in apiserver.patches if "/rayclusters/" in p[0]]


async def test_a_raycluster_whose_groups_changed_refuses_the_patch_with_the_real_422(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    """Someone renamed the group in the RayCluster: the JSON patch's `test` fails, and the
    API server answers as a real one does, without naming the operation."""
    b = await _running(make_backend, apiserver, 3)
    cluster = _cluster(apiserver)
    cluster["spec"]["workerGroupSpecs"][0]["groupName"] = "renamed"
    apiserver.put(f"/apis/ray.io/v1/namespaces/{NS}/rayclusters", cluster)
    with pytest.raises(CannotResize, match="the API server refused the resize") as got:
        await b.resize(elastic_dispatch(elastic_rayjob(), _counts(4), revision=1))
    assert "the server rejected our request due to an error in our request" in str(got.value)
    assert apiserver.patch_failures == [
        "testing value /spec/workerGroupSpecs/0/groupName failed: test failed"
    ]
    assert _group(apiserver)["replicas"] == 3


async def test_without_patch_on_rayclusters_the_resize_is_a_typed_refusal(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    b = await _running(make_backend, apiserver, 3)
    docs = copy.deepcopy(RbacAuthorizer.shipped().docs)
    for doc in docs:
        rules = doc.get("rules") or []
        doc["rules"] = [r for r in rules if "rayclusters" not in r.get("resources", [])]
    apiserver.authorizer = RbacAuthorizer(docs)
    with pytest.raises(CannotResize, match=r"may not patch rayclusters\.ray\.io in namespace"):
        await b.resize(elastic_dispatch(elastic_rayjob(), _counts(4), revision=1))
    assert apiserver.forbidden[-1]["reason"] == "Forbidden"
    assert _group(apiserver)["replicas"] == 3


async def test_a_custom_resource_refuses_a_strategic_merge_patch_as_a_real_server_does(
    api_client: Any, apiserver: FakeApiServer
) -> None:
    from agents.kube.client import KubeApiError, KubeRest

    apiserver.kuberay = KubeRay(seed=11)
    job = elastic_rayjob()
    job["metadata"]["name"] = "r"
    rest = KubeRest(api_client)
    await rest.create(f"/apis/ray.io/v1/namespaces/{NS}/rayjobs", job)
    name = _cluster(apiserver)["metadata"]["name"]
    with pytest.raises(KubeApiError) as got:
        await rest.request(
            "PATCH",
            f"/apis/ray.io/v1/namespaces/{NS}/rayclusters/{name}",
            body={"spec": {}},
            content_type="application/strategic-merge-patch+json",
        )
    assert got.value.status == 415
    assert "accepted media types include: application/json-patch+json, " in str(got.value)


def bare_raycluster(**spec: Any) -> dict[str, Any]:
    """The example RayCluster (elastic workers, 2 to 8), with `spec` fields added."""
    text = (EXAMPLES / "raycluster.yaml").read_text(encoding="utf-8")
    cluster: dict[str, Any] = yaml.safe_load(text)
    cluster["spec"].update(spec)
    return cluster


async def test_a_bare_raycluster_grows_and_shrinks_its_own_worker_group(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    manifest = bare_raycluster()
    apiserver.kuberay = KubeRay(seed=5)
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(manifest, _counts(4)))
    apiserver.kuberay.reconcile(apiserver)
    _bind(apiserver)
    await wait_for(lambda: len(b.attempts.pod_names.get(("j-1", 1), {})) == 4)
    await b.resize(elastic_dispatch(manifest, _counts(6), revision=1))
    assert _group(apiserver)["replicas"] == 6
    assert _pins(_group(apiserver)["template"]) == {f"{GROUP}-n{i}" for i in range(6)}
    apiserver.kuberay.reconcile(apiserver)
    _bind(apiserver)
    await wait_for(lambda: len(b.attempts.pod_names.get(("j-1", 1), {})) == 6)
    leaving = {
        p["metadata"]["name"] for p in _workers(apiserver) if p["spec"]["nodeName"] >= f"{GROUP}-n3"
    }
    await b.resize(elastic_dispatch(manifest, _counts(3), revision=2))
    group = _group(apiserver)
    assert group["replicas"] == 3 and set(group["scaleStrategy"]["workersToDelete"]) == leaving
    apiserver.kuberay.reconcile(apiserver)
    assert {p["spec"]["nodeName"] for p in _workers(apiserver)} == {
        f"{GROUP}-n{i}" for i in range(3)
    }
    assert [p[0].rsplit("/", 2)[1:] for p in apiserver.patches if "/rayclusters/" in p[0]] == [
        ["rayclusters", "j-1-a1"]
    ] * 2
    assert apiserver.rejected == []


async def test_a_recreate_upgrade_strategy_keeps_the_templates_and_refuses_growth_elsewhere(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    """KubeRay recreates every pod of a RayCluster whose template changes under Recreate."""
    manifest = bare_raycluster(upgradeStrategy={"type": "Recreate"})
    b, _ = await make_backend()
    await b.dispatch(elastic_dispatch(manifest, _counts(4)))
    template = copy.deepcopy(_group(apiserver)["template"])
    await b.resize(elastic_dispatch(manifest, _counts(3), revision=1))
    assert _group(apiserver)["replicas"] == 3 and _group(apiserver)["template"] == template
    with pytest.raises(CannotResize, match=r"Recreate .* cannot grow onto gpu-workers-n4"):
        await b.resize(elastic_dispatch(manifest, _counts(5), revision=2))
    assert _group(apiserver)["replicas"] == 3


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=4),
    data=st.data(),
)
def test_the_worker_group_patch_sets_every_changed_count_and_nothing_else(
    sizes: list[tuple[int, int]], data: st.DataObject
) -> None:
    """Any groups with any bounds, any new counts: applied by the stand-in as RFC 6902, the
    patch leaves each group at its new count (or is refused, outside its bounds, naming it),
    names the pods leaving a shrunk group, and touches no other field."""
    groups = [
        {"groupName": f"g{i}", "minReplicas": low, "maxReplicas": low + span, "replicas": low,
         "numOfHosts": 1, "template": {"spec": {"containers": [{"name": "w", "image": "i"}]}}}
        for i, (low, span) in enumerate(sizes)
    ]  # fmt: skip
    live = {"spec": {"workerGroupSpecs": groups}}
    new = copy.deepcopy(live)
    for g in new["spec"]["workerGroupSpecs"]:
        g["replicas"] = data.draw(st.integers(0, 12), label=g["groupName"])
    leaving = {g["groupName"]: [f"{g['groupName']}-p"] for g in groups}
    inside = all(
        g["minReplicas"] <= n["replicas"] <= g["maxReplicas"]
        for g, n in zip(groups, new["spec"]["workerGroupSpecs"], strict=True)
    )
    try:
        ops = group_ops(groups, new["spec"]["workerGroupSpecs"], "spec.workerGroupSpecs", leaving)
    except ResizeRefused as exc:
        assert not inside and "KubeRay runs worker group" in str(exc)
        return
    assert inside
    patched = json_patch(live, ops)
    for was, now, want in zip(
        groups, patched["spec"]["workerGroupSpecs"], new["spec"]["workerGroupSpecs"], strict=True
    ):
        assert now["replicas"] == want["replicas"]
        shrunk = want["replicas"] < was["replicas"]
        gone = (now.get("scaleStrategy") or {}).get("workersToDelete")
        assert gone == ([f"{was['groupName']}-p"] if shrunk else None)
        rest = {k: v for k, v in now.items() if k not in ("replicas", "scaleStrategy")}
        assert rest == {k: v for k, v in was.items() if k != "replicas"}
