"""The kube agent reports its topology: the agent's `topology.levels` on every flavor, and each
node's label value per level ("" when missing), so the broker keeps a gang within one zone."""

from __future__ import annotations

import msgspec
from kubernetes_asyncio.client import ApiClient

from agents.kube.backend import KubeBackend
from broker.core.records import demands_of
from broker.core.scheduler import Scheduler
from broker.core.topology import need_of
from broker.core.types import GangRequest
from broker.manifests import jobspec_from_manifest
from schemas.agent import ClusterSnapshot
from schemas.job import JobSpec
from tests.core.helpers import NOW, config
from tests.kube.conftest import NODES, Recorder, make_config, node
from tests.kube.fake_apiserver import FakeApiServer
from tests.support import fixture_doc

ZONE = "topology.kubernetes.io/zone"
BLOCK = "cloud.google.com/gce-topology-block"
HOST = "kubernetes.io/hostname"
LEVELS = (ZONE, HOST)


async def snapshot(api_client: ApiClient, levels: tuple[str, ...]) -> ClusterSnapshot:
    """What a kube agent reporting `levels` sends first."""
    backend = KubeBackend("c1", make_config(), api_client=api_client, topology_levels=levels)
    await backend.start(Recorder())
    try:
        return await backend.snapshot()
    finally:
        await backend.stop()


async def test_a_4_node_gang_lands_in_one_zone_of_a_kube_cluster(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    # Zone a has 3 nodes, zone b has 4: only b holds the gang; a node without a zone label
    # is reported with "" for the zone.
    for name, zone in [("a1", "a"), ("a2", "a"), ("a3", "a"), *((f"b{i}", "b") for i in range(4))]:
        apiserver.put(NODES, node(name, labels={"karpenter.sh/capacity-type": "spot", ZONE: zone}))
    apiserver.put(NODES, node("x1"))
    snap = await snapshot(api_client, LEVELS)
    assert {f.topology_levels for f in snap.flavors} == {LEVELS}
    paths = {n.name: n.topology for n in snap.nodes}
    assert paths["a1"] == ("a", "a1") and paths["b3"] == ("b", "b3") and paths["x1"] == ("", "x1")
    spec = msgspec.convert(
        {"name": "g", "gang": [{"name": "w", "replicas": 4, "gpu": 8}], "capacity": "spot"},
        JobSpec,
    )
    req = GangRequest("j", 1, "default", 0, 1, demands_of(spec), topology=need_of(spec))
    sched = Scheduler(config())
    spot = [f for f in snap.flavors if f.capacity_type == "spot"]
    sched.apply_snapshot("c1", spot, [n for n in snap.nodes if n.flavor == spot[0].name], NOW)
    res = sched.schedule([req], NOW)
    ((_, placed),) = res.admitted
    assert placed.nodes == {"b0", "b1", "b2", "b3"}


async def test_a_kueue_tas_manifest_lands_within_its_required_block(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    """The batch Job of Kueue's TAS sample (`podset-required-topology` on the template), on a
    kube cluster whose nodes carry GKE's block label: its two pods share one block, and with
    no block large enough it waits with the numbers instead of spanning two."""
    for name, block in [("n1", "b1"), ("n2", "b2"), ("n3", "b3"), ("n4", "b3")]:
        labels = {"karpenter.sh/capacity-type": "spot", ZONE: "a", BLOCK: block}
        apiserver.put(NODES, node(name, labels=labels))
    snap = await snapshot(api_client, (ZONE, BLOCK, HOST))
    manifest = fixture_doc("kueue-tas-sample-job.yaml")
    spec = jobspec_from_manifest(manifest)
    req = GangRequest("j", 1, "default", 0, 1, demands_of(spec), topology=need_of(spec))
    spot = [f for f in snap.flavors if f.capacity_type == "spot"]
    nodes = [n for n in snap.nodes if n.flavor == spot[0].name]
    sched = Scheduler(config())
    sched.apply_snapshot("c1", spot, nodes, NOW)
    ((_, placed),) = sched.schedule([req], NOW).admitted
    assert placed.nodes == {"n3", "n4"}
    sched = Scheduler(config())
    sched.apply_snapshot("c1", spot, [n for n in nodes if n.name != "n4"], NOW)
    res = sched.schedule([req], NOW)
    assert not res.admitted
    assert res.pending["j"][0].message == (
        f"needs 16 GPUs in one block; largest free block of c1/{spot[0].name} has 8"
    )
