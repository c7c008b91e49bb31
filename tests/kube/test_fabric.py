"""Fabric resources from a kube cluster to a placement: nodes whose allocatable lists EFA report
it, a manifest asking for EFA carries it per replica, and the gang lands only where it is free."""

from __future__ import annotations

from kubernetes_asyncio.client import ApiClient

from agents.kube.backend import KubeBackend
from broker.core.records import demands_of
from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest
from broker.manifests import jobspec_from_manifest
from tests.core.helpers import NOW, config
from tests.kube.conftest import NODES, Recorder, make_config, node
from tests.kube.fake_apiserver import FakeApiServer

EFA = "vpc.amazonaws.com/efa"


def efa_job(pods: int, efa: int) -> dict[str, object]:
    container = {
        "name": "w",
        "image": "busybox",
        "resources": {"limits": {"nvidia.com/gpu": "4", EFA: str(efa)}},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "efa"},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "completionMode": "Indexed",
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }


async def test_an_efa_gang_lands_only_on_nodes_with_efa_free(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    for name, efa in [("a-plain1", None), ("a-plain2", None), ("p5a", "32"), ("p5b", "16")]:
        raw = node(name)
        if efa is not None:
            raw["status"]["allocatable"][EFA] = efa
        apiserver.put(NODES, raw)
    backend = KubeBackend("c1", make_config(), api_client=api_client)
    await backend.start(Recorder())
    try:
        snap = await backend.snapshot()
    finally:
        await backend.stop()
    assert {n.name: n.extended for n in snap.nodes} == {
        "a-plain1": {},
        "a-plain2": {},
        "p5a": {EFA: 32},
        "p5b": {EFA: 16},
    }
    spec = jobspec_from_manifest(efa_job(3, 16))
    assert spec.gang[0].extended == {EFA: 16}
    sched = Scheduler(config())
    flavors = {n.flavor for n in snap.nodes}
    sched.apply_snapshot("c1", [f for f in snap.flavors if f.name in flavors], snap.nodes, NOW)
    req = GangRequest("j", 1, "default", 0, 1, demands_of(spec))
    ((_, placed),) = sched.schedule([req], NOW).admitted
    ((_, nodes),) = placed.assignment  # the plain nodes come first by name
    assert sorted(nodes) == ["p5a", "p5a", "p5b"]  # 32 EFA takes two replicas, 16 takes one
