"""The autoscaler stand-ins (tests/kube/autoscaler.py) behave as Karpenter and the cluster
autoscaler's ProvisioningRequest do, so the agent's tests against them mean something."""

from __future__ import annotations

from typing import Any

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kube.autoscaler import (
    ATOMIC,
    CHECK_CAPACITY,
    CONSUME,
    NODECLAIMS,
    NODEPOOLS,
    Autoscaler,
    nodepool,
)
from tests.kube.conftest import NS, PODS, pod
from tests.kube.fake_apiserver import FakeApiServer

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SPOT = {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}


def spot_pool(name: str = "gpu-spot", limits: dict[str, str] | None = None) -> dict[str, Any]:
    return nodepool(
        name,
        labels={"pool": "a100"},
        requirements=[SPOT],
        taints=[{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
        limits=limits or {"nvidia.com/gpu": "16"},
    )


def pending(name: str, gpu: int = 8, tolerate: bool = True, **annotations: str) -> dict[str, Any]:
    p = pod(name, None, namespace=NS, gpu=gpu, phase="Pending")
    p["spec"]["nodeSelector"] = {"pool": "a100", "karpenter.sh/capacity-type": "spot"}
    if tolerate:
        p["spec"]["tolerations"] = [GPU_TOLERATION]
    if annotations:
        p["metadata"]["annotations"] = dict(annotations)
    return p


async def post(server: FakeApiServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """A write as the platform team makes it (cluster-admin: no RBAC in the way)."""
    server.authorizer = None
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


async def test_a_nodepool_is_validated_against_the_upstream_crd(apiserver: FakeApiServer) -> None:
    Autoscaler(apiserver)
    code, _ = await post(apiserver, NODEPOOLS, spot_pool())
    assert code == 201
    bad = spot_pool("bad")
    bad["spec"]["template"]["spec"]["requirements"] = [{"key": "x", "operator": "Near"}]
    code, body = await post(apiserver, NODEPOOLS, bad)
    assert code == 422 and body["reason"] == "Invalid", body
    assert "operator" in body["message"]


async def test_pending_pods_that_fit_the_template_become_nodes_within_the_limit(
    apiserver: FakeApiServer,
) -> None:
    auto = Autoscaler(apiserver, seed=3)
    apiserver.put(NODEPOOLS, spot_pool(limits={"nvidia.com/gpu": "16"}))
    for i in range(3):
        apiserver.put(PODS, pending(f"p{i}"))
    apiserver.put(PODS, pending("untolerating", tolerate=False))
    auto.reconcile(0.0)
    claims = auto.nodeclaims("gpu-spot")
    assert len(claims) == 2  # 16 GPUs of limit: two 8-GPU nodes, the third pod waits
    assert not auto.launched
    auto.reconcile(1.0)  # past every seeded delay
    nodes = {n["metadata"]["name"]: n for n in apiserver.items("v1", "nodes")}
    assert sorted(nodes) == sorted(auto.launched) and len(nodes) == 2
    for n in nodes.values():
        labels = n["metadata"]["labels"]
        assert labels["pool"] == "a100" and labels["karpenter.sh/capacity-type"] == "spot"
        assert labels["karpenter.sh/nodepool"] == "gpu-spot"
        assert n["spec"]["taints"][0]["key"] == "nvidia.com/gpu"
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    for c in auto.nodeclaims("gpu-spot"):
        conds = {x["type"]: x["status"] for x in c["status"]["conditions"]}
        assert conds["Launched"] == "True" and c["status"]["nodeName"] in nodes


async def test_a_stockout_fails_the_launch_and_deletes_the_nodeclaim(
    apiserver: FakeApiServer,
) -> None:
    auto = Autoscaler(apiserver, stockouts={"gpu-spot"})
    apiserver.put(NODEPOOLS, spot_pool())
    apiserver.put(PODS, pending("p0"))
    seen: list[dict[str, Any]] = []
    auto.reconcile(0.0)
    name = auto.nodeclaims()[0]["metadata"]["name"]
    real_put = apiserver.put

    def spy(path: str, obj: dict[str, Any], silent: bool = False) -> dict[str, Any]:
        if path == NODECLAIMS:
            seen.append(obj)
        return real_put(path, obj, silent)

    apiserver.put = spy  # type: ignore[method-assign]
    auto.reconcile(1.0)
    assert apiserver.get(f"{NODECLAIMS}/{name}") is None
    assert not apiserver.items("v1", "nodes")
    launched = [c for x in seen for c in x["status"]["conditions"] if c["type"] == "Launched"]
    assert launched[-1]["status"] == "False" and launched[-1]["reason"] == "InsufficientCapacity"
    auto.reconcile(1.5)  # before retry_s: the pod is not tried again yet
    assert not auto.nodeclaims()
    auto.stockouts.clear()
    auto.reconcile(2.5)
    assert len(auto.nodeclaims()) == 1


def template(name: str) -> dict[str, Any]:
    spec = pending("x")["spec"]
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name},
        "template": {"spec": spec},
    }


def provreq(name: str, count: int, cls: str = ATOMIC) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling.x-k8s.io/v1",
        "kind": "ProvisioningRequest",
        "metadata": {"name": name},
        "spec": {
            "provisioningClassName": cls,
            "podSets": [{"count": count, "podTemplateRef": {"name": name}}],
        },
    }


def conditions(auto: Autoscaler, name: str) -> dict[str, tuple[str, str]]:
    pr = next(p for p in auto.requests() if p["metadata"]["name"] == name)
    return {c["type"]: (c["status"], c["reason"]) for c in pr["status"]["conditions"]}


PROVREQS = f"/apis/autoscaling.x-k8s.io/v1/namespaces/{NS}/provisioningrequests"
TEMPLATES = f"/api/v1/namespaces/{NS}/podtemplates"


async def test_provisioning_requests_are_served_only_when_installed(
    apiserver: FakeApiServer,
) -> None:
    Autoscaler(apiserver)
    code, body = await post(apiserver, PROVREQS, provreq("r", 1))
    assert code == 404 and body["reason"] == "NotFound"


async def test_an_atomic_request_provisions_the_whole_gang_or_nothing(
    apiserver: FakeApiServer,
) -> None:
    auto = Autoscaler(apiserver, provisioning_requests=True, booking_s=60)
    apiserver.put(NODEPOOLS, spot_pool(limits={"nvidia.com/gpu": "16"}))
    for name, count in (("fits", 2), ("too-big", 3)):
        assert (await post(apiserver, TEMPLATES, template(name)))[0] == 201
        assert (await post(apiserver, PROVREQS, provreq(name, count)))[0] == 201
    auto.reconcile(0.0)
    assert conditions(auto, "fits")["Accepted"] == ("True", "Accepted")
    # the first took the pool's whole limit: the second cannot get all three nodes, so none
    assert conditions(auto, "too-big")["Failed"][0] == "True"
    assert len(auto.nodeclaims()) == 2
    auto.reconcile(1.0)
    auto.reconcile(1.0)
    assert conditions(auto, "fits")["Provisioned"] == ("True", "CapacityIsProvisioned")
    assert len(apiserver.items("v1", "nodes")) == 2
    # a pod that consumes the request is not provisioned for again
    apiserver.put(PODS, pending("consumer", **{CONSUME: "fits"}))
    auto.reconcile(2.0)
    assert len(auto.nodeclaims()) == 2
    # check-capacity: the two nodes exist now
    assert (await post(apiserver, TEMPLATES, template("check")))[0] == 201
    assert (await post(apiserver, PROVREQS, provreq("check", 2, CHECK_CAPACITY)))[0] == 201
    auto.reconcile(3.0)
    assert conditions(auto, "check")["Provisioned"] == ("True", "CapacityIsFound")


async def test_a_stockout_fails_an_atomic_request_and_releases_its_nodes(
    apiserver: FakeApiServer,
) -> None:
    auto = Autoscaler(apiserver, provisioning_requests=True, booking_s=60)
    apiserver.put(NODEPOOLS, spot_pool())
    await post(apiserver, TEMPLATES, template("g"))
    await post(apiserver, PROVREQS, provreq("g", 2))
    auto.reconcile(0.0)
    auto.stockouts.add("gpu-spot")
    auto.reconcile(1.0)
    assert conditions(auto, "g")["Failed"][0] == "True"
    assert not auto.nodeclaims() and not apiserver.items("v1", "nodes")


async def test_an_unconsumed_booking_expires(apiserver: FakeApiServer) -> None:
    auto = Autoscaler(apiserver, provisioning_requests=True, booking_s=60)
    apiserver.put(NODEPOOLS, spot_pool())
    await post(apiserver, TEMPLATES, template("g"))
    await post(apiserver, PROVREQS, provreq("g", 1))
    for t in (0.0, 1.0, 2.0, 30.0):
        auto.reconcile(t)
    assert "BookingExpired" not in conditions(auto, "g")
    auto.reconcile(62.0)
    assert conditions(auto, "g")["BookingExpired"] == ("True", "CapacityReservationTimeExpired")


async def test_a_launched_node_is_kept_for_the_pod_it_was_launched_for(
    apiserver: FakeApiServer,
) -> None:
    auto = Autoscaler(apiserver)
    apiserver.put(NODEPOOLS, spot_pool())
    apiserver.put(PODS, pending("p0"))
    auto.reconcile(0.0)
    auto.reconcile(1.0)
    assert len(auto.launched) == 1
    apiserver.put(PODS, pending("p1"))  # p0 is not bound yet: its node is not free for p1
    auto.reconcile(1.0)
    assert len(auto.nodeclaims()) == 2


@settings(max_examples=40, deadline=None)
@given(
    limit=st.integers(0, 48),
    pods=st.lists(st.tuples(st.integers(1, 8), st.booleans()), max_size=8),
    stocked_out=st.booleans(),
)
def test_the_provisioner_keeps_every_pool_within_its_limits(
    limit: int, pods: list[tuple[int, bool]], stocked_out: bool
) -> None:
    """Whatever pods arrive, the NodeClaims of a pool never hold more GPUs than its limits,
    each node launched fits its pod's template, and a stocked-out pool launches nothing."""
    server = FakeApiServer()
    auto = Autoscaler(server, seed=limit, stockouts={"gpu-spot"} if stocked_out else set())
    server.put(NODEPOOLS, spot_pool(limits={"nvidia.com/gpu": str(limit)}))
    for i, (gpu, tolerate) in enumerate(pods):
        server.put(PODS, pending(f"p{i}", gpu=gpu, tolerate=tolerate))
    for t in (0.0, 0.5, 1.0, 3.0):
        auto.reconcile(t)
        held = sum(
            int(c["spec"]["resources"]["requests"]["nvidia.com/gpu"]) for c in auto.nodeclaims()
        )
        assert held <= limit
    assert len(auto.launched) <= sum(1 for _, tolerate in pods if tolerate)
    if stocked_out:
        assert not auto.launched and not server.items("v1", "nodes")
