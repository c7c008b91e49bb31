"""Where topology comes from: the fake backend's zones, blocks and racks, a Kueue `Topology`
object as an agent's level list, and Kueue's TAS podset annotations on a manifest's
templates, each through to where the core places a gang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from agents.config import FakeClusterConfig, FakeFlavor, TopologyConfig, topology_from_kueue
from agents.fake.model import ClusterModel, ManualClock
from broker.core.records import demands_of, spot_ok
from broker.core.scheduler import Scheduler
from broker.core.topology import depth_of, need_of
from broker.core.types import GangRequest
from broker.manifests import ManifestError, jobspec_from_manifest
from kinds.base import KindError
from kinds.demand import container_demand
from kinds.topology import JOBSET_EXCLUSIVE, podset_topology
from schemas.job import JobSpec
from tests.support import fixture_doc

from .helpers import NOW, config

GCE = [
    "topology.kubernetes.io/zone",
    "cloud.google.com/gce-topology-block",
    "cloud.google.com/gce-topology-subblock",
    "kubernetes.io/hostname",
]


def fake_cluster(levels: list[str]) -> ClusterModel:
    cfg = FakeClusterConfig(
        flavors=[FakeFlavor(name="od", nodes=8, zones=2, blocks=2, racks=2)],
        topology=TopologyConfig(levels=levels),
    )
    return ClusterModel("c", cfg, ManualClock())


def test_the_fake_cluster_reports_zones_blocks_racks_and_hosts() -> None:
    snap = fake_cluster(GCE).view()
    assert snap.flavors[0].topology_levels == tuple(GCE)
    paths = [n.topology for n in snap.nodes]
    assert paths[0] == ("zone-0", "block-0-0", "rack-0-0-0", "c-od-0")
    assert paths[7] == ("zone-1", "block-1-1", "rack-1-1-1", "c-od-7")
    assert len({p[:3] for p in paths}) == 8  # one node per rack
    # Two levels only: the zone, then the host (not the block in the host's place).
    two = fake_cluster([GCE[0], GCE[3]]).view()
    assert two.nodes[1].topology == ("zone-0", "c-od-1")


def test_a_kueue_topology_object_becomes_the_level_list() -> None:
    obj = {
        "apiVersion": "kueue.x-k8s.io/v1alpha1",
        "kind": "Topology",
        "metadata": {"name": "default"},
        "spec": {"levels": [{"nodeLabel": lv} for lv in GCE[1:]]},
    }
    assert topology_from_kueue(obj).levels == GCE  # the zone goes first
    with pytest.raises(ValueError, match="not a Kueue Topology"):
        topology_from_kueue({"kind": "ResourceFlavor"})
    with pytest.raises(ValueError, match=r"first level must be topology\.kubernetes\.io/zone"):
        TopologyConfig(levels=[GCE[1], GCE[0]])


def tas_template(**annotations: str) -> dict[str, object]:
    return {"metadata": {"annotations": annotations}, "spec": {"containers": []}}


def test_kueue_tas_annotations_become_the_podset_topology() -> None:
    t = tas_template(
        **{
            "kueue.x-k8s.io/podset-required-topology": "cloud.google.com/gce-topology-block",
            "kueue.x-k8s.io/podset-preferred-topology": "kubernetes.io/hostname",
        }
    )
    fields = podset_topology(t, "spec.template")
    assert fields == {
        "topology": {
            "required": "cloud.google.com/gce-topology-block",
            "preferred": "kubernetes.io/hostname",
        }
    }
    assert podset_topology(tas_template(), "spec.template") == {}
    with pytest.raises(KindError, match="is not a node label key"):
        podset_topology(
            tas_template(**{"kueue.x-k8s.io/podset-required-topology": "a b"}), "spec.template"
        )


def test_a_required_block_from_a_manifest_holds_on_the_fake_fleet() -> None:
    """The TAS annotation, the JobSpec, the core's need, and the fake's nodes, end to end."""
    pod = podset_topology(
        tas_template(
            **{"kueue.x-k8s.io/podset-required-topology": "cloud.google.com/gce-topology-block"}
        ),
        "spec.template",
    )
    spec = msgspec.convert(
        {"name": "tas", "gang": [{"name": "w", "replicas": 2, "gpu": 8, **pod}]}, JobSpec
    )
    req = GangRequest("j", 1, "default", 0, 1, demands_of(spec), topology=need_of(spec))
    snap = fake_cluster(GCE).view()
    for n in snap.nodes[1::2]:  # one node of every block busy: each block has 8 GPUs free
        n.other_gpu = 8
    s = Scheduler(config())
    s.apply_snapshot("c", snap.flavors, snap.nodes, NOW)
    res = s.schedule([req], NOW)
    assert not res.admitted
    assert res.pending["j"][0].message == (
        "needs 16 GPUs in one block; largest free block of c/od has 8"
    )
    snap.nodes[1].other_gpu = 0
    s.upsert_node("c", snap.nodes[1], NOW)
    res = s.schedule([req], NOW)
    ((_, p),) = res.admitted
    assert p.nodes == {"c-od-0", "c-od-1"}  # block-0-0, the one block that fits


def test_fabric_resources_are_counted_and_others_are_still_refused() -> None:
    def container(**limits: object) -> dict[str, object]:
        return {"resources": {"limits": {"nvidia.com/gpu": 8, **limits}}}

    fabric = container(**{"vpc.amazonaws.com/efa": 32, "rdma/ib": 1, "hugepages-2Mi": "1Gi"})
    demand = container_demand(fabric, "c")
    assert demand.gpu == 8
    assert demand.extended == {"vpc.amazonaws.com/efa": 32, "rdma/ib": 1, "hugepages-2Mi": 2**30}
    with pytest.raises(KindError, match=r"not a whole count of vpc\.amazonaws\.com/efa"):
        container_demand(container(**{"vpc.amazonaws.com/efa": "0.5"}), "c")
    with pytest.raises(KindError, match="is not a resource any cluster offers"):
        container_demand(container(**{"google.com/tpu": 4}), "c")


def test_a_kueue_tas_manifest_submitted_as_is_carries_its_topology() -> None:
    """The annotations of Kueue's TAS docs on a batch Job reach the JobSpec's podset."""
    manifest = fixture_doc("kueue-tas-sample-job.yaml")
    spec = jobspec_from_manifest(manifest)
    (podset,) = spec.gang
    assert podset.topology is not None
    assert podset.topology.required == "cloud.google.com/gce-topology-block"


def test_a_manifest_says_spot_is_fine_with_its_label() -> None:
    """`muster.dev/spot-ok` on a manifest's metadata reaches the job, as the refusal text and
    docs/decisions.md tell users to set it."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"muster.dev/spot-ok": "true"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "w", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
    }
    assert spot_ok(jobspec_from_manifest(manifest))
    del manifest["metadata"]["labels"]
    assert not spot_ok(jobspec_from_manifest(manifest))


FIXTURES = Path(__file__).parent.parent / "cli" / "fixtures"


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((FIXTURES / name).read_text())
    return loaded


def volcano(network: object) -> dict[str, Any]:
    manifest = fixture("volcano-job.yaml")
    manifest["spec"]["networkTopology"] = network
    return manifest


def test_volcano_network_topology_becomes_the_gang_level() -> None:
    def level(network: object) -> tuple[str | None, str | None]:
        topo = jobspec_from_manifest(volcano(network)).topology
        assert topo is not None
        return topo.required, topo.preferred

    assert jobspec_from_manifest(fixture("volcano-job.yaml")).topology is None
    assert level({"mode": "hard", "highestTierAllowed": 2}) == ("tier-2", None)
    assert level({}) == ("tier-1", None)  # the CRD's defaults: hard, tier 1
    assert level({"mode": "soft", "highestTierAllowed": 3}) == (None, "tier-3")
    assert level({"highestTierName": "cloud.google.com/gce-topology-block"}) == (
        "cloud.google.com/gce-topology-block",
        None,
    )
    for bad, said in (
        ({"mode": "strict"}, "supported values: hard, soft"),
        ({"highestTierAllowed": 0}, "tiers count from 1"),
        ({"highestTierAllowed": 1, "highestTierName": "rack"}, "keep one of them"),
    ):
        with pytest.raises(ManifestError, match=said):
            jobspec_from_manifest(volcano(bad))


def test_a_tier_counts_up_from_the_finest_level_above_the_host() -> None:
    levels = tuple(GCE)  # zone, block, subblock, host
    assert [depth_of(levels, f"tier-{n}") for n in (1, 2, 3, 9)] == [3, 2, 1, 1]
    assert depth_of(levels[:3], "tier-1") == 3  # no host level: the finest one is tier 1
    assert depth_of((), "tier-1") == 0
    assert depth_of(levels, "tier-0") == 0


def test_a_volcano_hard_tier_holds_on_the_fake_fleet() -> None:
    """`highestTierAllowed: 1` keeps the gang in one subblock, 2 in one block."""
    snap = fake_cluster(GCE).view()  # one 8-GPU node per subblock
    s = Scheduler(config())
    s.apply_snapshot("c", snap.flavors, snap.nodes, NOW)

    def request(tier: int) -> GangRequest:
        manifest = volcano({"mode": "hard", "highestTierAllowed": tier})
        manifest["spec"]["tasks"] = manifest["spec"]["tasks"][1:]  # the workers only
        manifest["spec"]["minAvailable"] = 2
        worker = manifest["spec"]["tasks"][0]
        worker["replicas"] = 2
        worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 8
        spec = jobspec_from_manifest(manifest)
        return GangRequest(f"t{tier}", 1, "default", 0, 1, demands_of(spec), topology=need_of(spec))

    res = s.schedule([request(1)], NOW)
    assert res.pending["t1"][0].message == (
        "needs 16 GPUs in one subblock; largest free subblock of c/od has 8"
    )
    res = s.schedule([request(2)], NOW)
    ((_, p),) = res.admitted
    nodes = {n.name: n.topology for n in snap.nodes}
    assert len({nodes[n][:2] for n in p.nodes}) == 1  # both in one block


def jobset(exclusive: str | None, replicas: int = 2) -> dict[str, Any]:
    manifest = fixture("jobset-llm.yaml")
    manifest["spec"]["replicatedJobs"][1]["replicas"] = replicas
    if exclusive is not None:
        manifest["metadata"]["annotations"] = {JOBSET_EXCLUSIVE: exclusive}
    return manifest


def test_jobset_exclusive_topology_becomes_the_gang_level() -> None:
    """One child Job must fit its domain; several are kept as tight as they fit."""
    pool = "cloud.google.com/gke-nodepool"
    assert jobspec_from_manifest(jobset(None)).topology is None
    topo = jobspec_from_manifest(jobset(pool)).topology
    assert topo is not None
    assert (topo.required, topo.preferred) == (None, pool)  # driver + 2 worker Jobs
    single = jobset(pool, replicas=1)
    del single["spec"]["replicatedJobs"][0]  # the workers' one Job only
    topo = jobspec_from_manifest(single).topology
    assert topo is not None
    assert (topo.required, topo.preferred) == (pool, None)
    with pytest.raises(ManifestError, match="is not a node label key"):
        jobspec_from_manifest(jobset("two words"))


def test_a_replicated_job_annotation_binds_its_podset() -> None:
    manifest = jobset(None, replicas=1)
    workers = manifest["spec"]["replicatedJobs"][1]
    block = "cloud.google.com/gce-topology-block"
    workers["template"]["metadata"] = {"annotations": {JOBSET_EXCLUSIVE: block}}
    spec = jobspec_from_manifest(manifest)
    by_name = {p.name: p.topology for p in spec.gang}
    assert by_name["driver"] is None
    worker = by_name["workers"]
    assert worker is not None
    assert (worker.required, worker.preferred) == (block, None)
    # Kueue's annotation on the pod template wins where both name a level.
    pod = workers["template"]["spec"]["template"]
    pod["metadata"] = {"annotations": {"kueue.x-k8s.io/podset-required-topology": "rack"}}
    worker = {p.name: p.topology for p in jobspec_from_manifest(manifest).gang}["workers"]
    assert worker is not None
    assert worker.required == "rack"


def test_a_manifest_carries_its_fabric_resources_per_replica() -> None:
    manifest = jobset(None)
    trainer = manifest["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]
    limits = trainer["containers"][0]["resources"]["limits"]
    limits.update({"vpc.amazonaws.com/efa": 4, "hugepages-2Mi": "512Mi"})
    by_name = {p.name: p.extended for p in jobspec_from_manifest(manifest).gang}
    assert by_name == {
        "driver": {},
        "workers": {"vpc.amazonaws.com/efa": 4, "hugepages-2Mi": 512 * 2**20},
    }
