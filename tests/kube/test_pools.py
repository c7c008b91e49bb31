"""Autoscaled pools read from the cluster and grown on the broker's ask (agents/kube/pools.py),
against the stand-in API server and its autoscalers (tests/kube/autoscaler.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.backend import BackendError
from agents.kube.backend import KubeBackend
from agents.kube.config import AutoscalingConfig
from agents.kube.decode import KNodeClaim, KNodePool
from agents.kube.pools import (
    CONSUME,
    LABEL_ASK,
    read_pools,
    room_nodes,
)
from schemas.agent import ClusterSnapshot, Provision, ProvisionPool, WorkloadStatus
from tests.kube.autoscaler import NODEPOOLS, Autoscaler, nodepool
from tests.kube.conftest import NS, PODS, Recorder, caught_up, gang_dispatch, make_config
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.rbac_authz import RbacAuthorizer
from tests.kube.scheduling import schedule
from tests.support import wait_for

GPU8 = {"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "In", "values": ["8"]}
CPU96 = {"key": "karpenter.k8s.aws/instance-cpu", "operator": "In", "values": ["96"]}
SPOT = {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}


def spot_pool(name: str = "gpu-spot", gpus: str = "16", **kw: Any) -> dict[str, Any]:
    return nodepool(
        name,
        labels={"pool": "a100"},
        requirements=[SPOT, GPU8, CPU96],
        taints=[GPU_TAINT],
        limits={"nvidia.com/gpu": gpus},
        **kw,
    )


def decoded(obj: dict[str, Any], kind: type[Any]) -> Any:
    return msgspec.convert(obj, kind, strict=False)


CFG = AutoscalingConfig(ready_s=120, window_s=600)


def test_a_nodepool_is_the_pool_of_the_flavor_whose_nodes_it_makes() -> None:
    config = make_config()
    pools = [decoded(spot_pool(), KNodePool)]
    got = read_pools(pools, [], config, CFG, {})
    assert list(got) == ["a100-spot"]  # spot only: not the on-demand flavor of the same label
    p = got["a100-spot"]
    assert (p.node_gpu, p.node_cpu_milli, p.max_nodes) == (8, 96_000, 2)
    assert p.labels == {
        "karpenter.sh/nodepool": "gpu-spot",
        "karpenter.sh/capacity-type": "spot",
        "pool": "a100",
    }
    assert [t.key for t in p.taints] == ["nvidia.com/gpu"]
    assert (p.ready_s, p.window_s) == (120, 600)
    # a pool without capacity type constraint launches on-demand (Karpenter's default)
    od = spot_pool("gpu-od")
    od["spec"]["template"]["spec"]["requirements"] = [GPU8]
    assert list(read_pools([decoded(od, KNodePool)], [], config, CFG, {})) == ["a100-od"]
    # other labels: no flavor; unknown GPUs per node: skipped unless declared
    other = spot_pool()
    other["spec"]["template"]["metadata"]["labels"] = {"pool": "h100"}
    assert read_pools([decoded(other, KNodePool)], [], config, CFG, {}) == {}
    vague = spot_pool()
    vague["spec"]["template"]["spec"]["requirements"] = [SPOT]
    assert read_pools([decoded(vague, KNodePool)], [], config, CFG, {}) == {}
    declared = msgspec.convert({"node_figures": {"gpu-spot": {"gpu": 4}}}, AutoscalingConfig)
    got = read_pools([decoded(vague, KNodePool)], [], config, declared, {})
    assert got["a100-spot"].node_gpu == 4 and got["a100-spot"].max_nodes == 4


def test_an_instance_type_requirement_gives_the_node_figures_of_the_smallest_type() -> None:
    config = make_config()
    pool = spot_pool()
    itype = {"key": "node.kubernetes.io/instance-type", "operator": "In"}
    reqs = pool["spec"]["template"]["spec"]["requirements"] = [
        SPOT,
        {**itype, "values": ["p5.48xlarge", "p4d.24xlarge"]},
    ]
    got = read_pools([decoded(pool, KNodePool)], [], config, CFG, {})["a100-spot"]
    # Karpenter's documented allocatable: p4d 95690m / 1082712Mi, p5 191450m / 1938410Mi
    assert (got.node_gpu, got.node_cpu_milli, got.node_memory) == (8, 95_690, 1082712 * 2**20)
    reqs[1]["values"] = ["p4d.24xlarge", "x9.unknown"]  # one type not known: not guessed
    assert read_pools([decoded(pool, KNodePool)], [], config, CFG, {}) == {}


def test_the_limit_is_the_nodes_there_plus_what_the_nodeclaims_leave() -> None:
    config = make_config()
    claim = {
        "metadata": {"name": "c1", "labels": {"karpenter.sh/nodepool": "gpu-spot"}},
        "status": {"capacity": {"nvidia.com/gpu": "8"}},
    }
    pools = [decoded(spot_pool(gpus="32"), KNodePool)]
    claims = [decoded(claim, KNodeClaim)]
    # 32 GPUs: one 8-GPU NodeClaim held (its node is there), room for 3 more
    assert read_pools(pools, claims, config, CFG, {"a100-spot": 1})["a100-spot"].max_nodes == 4
    full = [decoded(spot_pool(gpus="8"), KNodePool)]
    assert read_pools(full, claims, config, CFG, {}) == {}  # nothing there, nothing to add


@given(
    limit=st.integers(0, 512),
    held=st.lists(st.integers(0, 16), max_size=20),
    per_node=st.integers(1, 16),
)
def test_room_is_never_negative_and_never_breaks_the_limit(
    limit: int, held: list[int], per_node: int
) -> None:
    pool = decoded(spot_pool(gpus=str(limit)), KNodePool)
    claims = [
        decoded({"status": {"capacity": {"nvidia.com/gpu": str(h)}}}, KNodeClaim) for h in held
    ]
    room = room_nodes(pool, claims, {"nvidia.com/gpu": float(per_node)}, 1000)
    assert room >= 0
    assert room == 0 or sum(held) + room * per_node <= limit


# -- against the stand-in ---------------------------------------------------------------------


def allow_autoscaling(server: FakeApiServer) -> None:
    server.authorizer = RbacAuthorizer.with_optional("autoscaling-rbac")


@contextlib.asynccontextmanager
async def running(auto: Autoscaler) -> AsyncIterator[Autoscaler]:
    """The provisioner reconciling on the loop's clock for the test's duration."""
    task = asyncio.create_task(auto.run())
    try:
        yield auto
    finally:
        if task.done():
            task.result()  # a stand-in that failed fails the test with its own error
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def provision(job_id: str = "job-1", nodes: int = 2, deadline: float = 0.0) -> Provision:
    return Provision(job_id=job_id, epoch=1, flavor="a100-spot", nodes=nodes, deadline=deadline)


def spot_flavor(snap: Any) -> Any:
    return next(f for f in snap.flavors if f.name == "a100-spot")


async def test_a_pool_at_zero_nodes_is_reported_and_grows_on_the_ask(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    allow_autoscaling(apiserver)
    apiserver.put(NODEPOOLS, spot_pool())
    backend, _ = await make_backend(autoscaling={"provisioning_request": "off"})
    async with running(Autoscaler(apiserver, seed=7)):
        await grows_on_the_ask(apiserver, backend)


async def grows_on_the_ask(apiserver: FakeApiServer, backend: Any) -> None:
    snap = await backend.snapshot()
    assert spot_flavor(snap).provision.max_nodes == 2 and not snap.nodes
    await backend.provision(provision())
    holders = [p for p in apiserver.items("v1", "pods") if LABEL_ASK in p["metadata"]["labels"]]
    assert len(holders) == 2
    for p in holders:  # pinned by the pool's labels, tolerating its taint, one node each
        assert p["spec"]["nodeSelector"]["karpenter.sh/nodepool"] == "gpu-spot"
        assert any(t["key"] == "nvidia.com/gpu" for t in p["spec"]["tolerations"])
        assert p["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    await wait_for(lambda: len(backend.node_signals()) == 2, what="two nodes from the NodePool")
    snap = await backend.snapshot()
    assert {n.flavor for n in snap.nodes} == {"a100-spot"}
    # the scheduler binds the placeholders there: they hold nothing the broker must not use
    for p in schedule(apiserver.items("v1", "nodes"), holders):
        apiserver.put(PODS, p)
    await caught_up(apiserver, backend)
    snap = await backend.snapshot()
    assert all(n.other_gpu == 0 for n in snap.nodes)
    # the gang is dispatched on the new nodes: the placeholders make room for it
    nodes = sorted(n.name for n in snap.nodes)
    cmd = gang_dispatch()
    cmd = msgspec.structs.replace(
        cmd, assignment=[msgspec.structs.replace(cmd.assignment[0], nodes=nodes)]
    )
    await backend.dispatch(cmd)
    left = [p for p in apiserver.items("v1", "pods") if LABEL_ASK in p["metadata"]["labels"]]
    assert all(p["metadata"].get("deletionTimestamp") for p in left)


async def test_without_the_optional_role_no_pool_is_read(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODEPOOLS, spot_pool())
    backend, _ = await make_backend(autoscaling={"provisioning_request": "off"})
    assert spot_flavor(await backend.snapshot()).provision is None
    assert any("nodepools" in str(f.get("message")) for f in apiserver.forbidden)


async def test_with_provisioning_request_the_whole_gang_is_asked_at_once(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    allow_autoscaling(apiserver)
    auto = Autoscaler(apiserver, provisioning_requests=True, seed=2)
    apiserver.put(NODEPOOLS, spot_pool())
    backend, _ = await make_backend(autoscaling={})
    await backend.provision(provision(nodes=2))
    (pr,) = auto.requests()
    assert pr["spec"]["provisioningClassName"] == "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    assert pr["spec"]["podSets"][0]["count"] == 2
    assert not [p for p in apiserver.items("v1", "pods")]  # no placeholders with a request
    for t in (0.0, 1.0, 1.0):
        auto.reconcile(t)
    assert any(c["type"] == "Provisioned" for c in auto.requests()[0]["status"]["conditions"])
    await wait_for(lambda: len(backend.node_signals()) == 2, what="the request's two nodes")
    nodes = sorted(backend.node_signals())
    cmd = gang_dispatch()
    cmd = msgspec.structs.replace(
        cmd, assignment=[msgspec.structs.replace(cmd.assignment[0], nodes=nodes)]
    )
    await backend.dispatch(cmd)
    job = apiserver.items("batch/v1", "jobs")[0]
    assert job["spec"]["template"]["metadata"]["annotations"][CONSUME] == pr["metadata"]["name"]


async def test_a_failed_request_is_withdrawn(apiserver: FakeApiServer, make_backend: Any) -> None:
    allow_autoscaling(apiserver)
    auto = Autoscaler(apiserver, provisioning_requests=True, stockouts={"gpu-spot"})
    apiserver.put(NODEPOOLS, spot_pool())
    backend, _ = await make_backend(autoscaling={})
    await backend.provision(provision(nodes=2))
    for t in (0.0, 1.0):
        auto.reconcile(t)
    await wait_for(
        lambda: not auto.requests() and not apiserver.items("v1", "podtemplates"),
        what="the failed request and its template deleted",
    )
    assert backend.autoscaling is not None and backend.autoscaling.failed == ["job-1"]
    assert not apiserver.items("v1", "nodes")


def still_asked(server: FakeApiServer) -> int:
    """Placeholder pods not being deleted, and ProvisioningRequests."""
    pods = [p for p in server.items("v1", "pods") if not p["metadata"].get("deletionTimestamp")]
    return len(pods) + len(server.items("autoscaling.x-k8s.io/v1", "provisioningrequests"))


async def asked_backend(
    server: FakeApiServer, make_backend: Any, mode: str, deadline: float = 0.0
) -> Any:
    """A backend that asked for job-1's two nodes (placeholders, or a request when `mode` is
    "on"), with the optional role and a cluster that serves ProvisioningRequest."""
    allow_autoscaling(server)
    Autoscaler(server, provisioning_requests=True)
    server.put(NODEPOOLS, spot_pool())
    backend, _ = await make_backend(autoscaling={"provisioning_request": mode})
    await backend.provision(provision(deadline=deadline))
    return backend


@pytest.mark.parametrize("mode", ["off", "on"])
async def test_what_is_still_asked_at_the_deadline_is_withdrawn(
    apiserver: FakeApiServer, make_backend: Any, mode: str
) -> None:
    backend = await asked_backend(apiserver, make_backend, mode, deadline=1_000_000.2)
    assert still_asked(apiserver)  # the clock says 1,000,000: withdrawn 0.2 s later
    await wait_for(lambda: not still_asked(apiserver), what="the ask withdrawn")
    assert backend.autoscaling is not None and not backend.autoscaling.asks


async def test_a_nodepool_edit_asks_for_a_snapshot_with_the_new_limit(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    allow_autoscaling(apiserver)
    apiserver.put(NODEPOOLS, spot_pool(gpus="16"))
    backend, rec = await make_backend(autoscaling={"provisioning_request": "off"})
    assert spot_flavor(await backend.snapshot()).provision.max_nodes == 2
    apiserver.put(
        NODEPOOLS, {**spot_pool(gpus="16"), "metadata": {"name": "gpu-spot", "labels": {"x": "y"}}}
    )
    await caught_up(apiserver, backend)
    assert not rec.of(ClusterSnapshot)  # nothing the broker sees changed: no snapshot
    apiserver.put(NODEPOOLS, spot_pool(gpus="64"))
    await rec.wait_for(lambda: rec.of(ClusterSnapshot))
    assert spot_flavor(await backend.snapshot()).provision.max_nodes == 8


@pytest.mark.parametrize("mode", ["off", "on"])
async def test_a_restarted_agent_adopts_the_asks_it_made_and_cancel_releases_them(
    apiserver: FakeApiServer, make_backend: Any, mode: str
) -> None:
    first = await asked_backend(apiserver, make_backend, mode)
    await first.stop()
    assert still_asked(apiserver) in (1, 2)  # a request, or two placeholders
    second, _ = await make_backend(autoscaling={"provisioning_request": mode})
    assert second.autoscaling is not None and list(second.autoscaling.asks) == ["job-1"]
    await second.cancel("job-1", None, "cancelled")
    assert still_asked(apiserver) == 0


@pytest.mark.parametrize("served", [False, True])
async def test_a_pool_declared_in_the_agent_config_is_asked_without_reading_nodepools(
    apiserver: FakeApiServer, api_client: Any, served: bool
) -> None:
    """A cluster-autoscaler node group from 0: declared, not read; with the shipped RBAC
    only (placeholders), or with the optional role where ProvisioningRequest is served."""
    if served:
        allow_autoscaling(apiserver)
        Autoscaler(apiserver, provisioning_requests=True)
    declared = ProvisionPool(
        node_gpu=8, max_nodes=3, labels={"eks.amazonaws.com/nodegroup": "gpu-spot"}
    )
    backend = KubeBackend(
        "c1", make_config(), api_client=api_client, declared_pools={"a100-spot": declared}
    )
    await backend.start(Recorder())
    try:
        assert backend.autoscaling is not None
        watched = {r.name for r in backend.autoscaling.reflectors}
        assert watched == ({"provisioningrequests"} if served else set())  # no NodePool read
        assert spot_flavor(await backend.snapshot()).provision is None  # the runtime adds it
        await backend.provision(provision(nodes=3))
        if served:
            (tmpl,) = apiserver.items("v1", "podtemplates")
            holders = [{"spec": tmpl["template"]["spec"]}]
            assert still_asked(apiserver) == 1
        else:
            holders = [
                p for p in apiserver.items("v1", "pods") if LABEL_ASK in p["metadata"]["labels"]
            ]
            assert len(holders) == 3
        assert holders[0]["spec"]["nodeSelector"] == {
            "pool": "a100",
            "eks.amazonaws.com/nodegroup": "gpu-spot",
        }
        with pytest.raises(BackendError, match="declares none"):
            await backend.provision(msgspec.structs.replace(provision(), flavor="a100-od"))
    finally:
        await backend.stop()


async def test_a_half_made_ask_is_undone_so_the_resent_ask_makes_it_whole(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    allow_autoscaling(apiserver)
    Autoscaler(apiserver, provisioning_requests=True)
    apiserver.put(NODEPOOLS, spot_pool())
    backend, _ = await make_backend(autoscaling={"provisioning_request": "on"})
    apiserver.fail_next("POST", f"/apis/autoscaling.x-k8s.io/v1/namespaces/{NS}/", 500)
    with pytest.raises(BackendError):
        await backend.provision(provision())
    assert not apiserver.items("v1", "podtemplates")  # the template made first is gone
    await backend.provision(provision())
    assert still_asked(apiserver) == 1 and len(apiserver.items("v1", "podtemplates")) == 1


async def test_the_request_goes_when_the_gang_that_consumed_it_finishes(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    allow_autoscaling(apiserver)
    auto = Autoscaler(apiserver, provisioning_requests=True)
    apiserver.put(NODEPOOLS, spot_pool())
    backend, rec = await make_backend(autoscaling={})
    await backend.provision(provision())
    for t in (0.0, 1.0, 1.0):
        auto.reconcile(t)
    await wait_for(lambda: len(backend.node_signals()) == 2, what="the request's nodes")
    cmd = gang_dispatch()
    nodes = sorted(backend.node_signals())
    cmd = msgspec.structs.replace(
        cmd, assignment=[msgspec.structs.replace(cmd.assignment[0], nodes=nodes)]
    )
    await backend.dispatch(cmd)
    assert still_asked(apiserver) == 1  # kept while the gang's pods consume it
    (job,) = apiserver.items("batch/v1", "jobs")
    job = {
        **job,
        "status": {"succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]},
    }
    apiserver.put(f"/apis/batch/v1/namespaces/{NS}/jobs", job)
    await rec.wait_for(lambda: any(s.phase == "succeeded" for s in rec.of(WorkloadStatus)))
    await wait_for(lambda: not still_asked(apiserver), what="the request deleted")


async def test_an_adopted_ask_whose_gang_never_comes_is_withdrawn_a_window_later(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    first = await asked_backend(apiserver, make_backend, "off")
    await first.stop()
    assert still_asked(apiserver) == 2
    scaling = {"provisioning_request": "off", "ready_s": 0.1, "window_s": 0.3}
    second, _ = await make_backend(autoscaling=scaling)
    assert second.autoscaling is not None and list(second.autoscaling.asks) == ["job-1"]
    await wait_for(lambda: not still_asked(apiserver), what="the adopted ask withdrawn")
