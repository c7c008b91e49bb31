"""Holding the chosen nodes: a pool dedicated to Muster carries a taint only Muster's pods of
that flavor tolerate, so no other scheduler's pod lands on a node the broker chose while
Muster's gang is on its way (docs/kubernetes.md "Holding the chosen nodes")."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest
import yaml

from agents.config import convert_agent_config
from agents.kube.backend import KubeBackend
from agents.kube.config import KubeConfigError, build_workload
from agents.kube.decode import KNode
from agents.kube.nodes import Rules, untolerated_taints
from broker.config import parse_config
from schemas.agent import WorkloadStatus
from tests.kube.conftest import (
    BASE_CONFIG,
    NODES,
    PODS,
    caught_up,
    gang_dispatch,
    make_config,
    node,
    run_job_pod,
)
from tests.kube.deploy_tree import configmap_data
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.scheduling import make_node, pods_from_template, schedule

TAINT = {"key": "muster.dev/dedicated", "value": "muster", "effect": "NoSchedule"}


def dedicated_flavors(**taint: Any) -> list[dict[str, Any]]:
    flavors = copy.deepcopy(BASE_CONFIG["flavors"])
    flavors[0]["dedicated_taint"] = taint
    return flavors


def test_dedicated_flavor_counts_its_tainted_nodes_and_others_do_not() -> None:
    cfg = make_config(flavors=dedicated_flavors())
    spot, od = cfg.flavors
    raw = node("n", taints=[TAINT])
    tainted = msgspec.convert(raw, KNode, strict=False)
    rules = Rules(cfg)
    assert untolerated_taints(tainted, spot, rules) == []
    assert untolerated_taints(tainted, od, rules) == ["muster.dev/dedicated=muster:NoSchedule"]


def test_only_musters_pods_bind_on_a_dedicated_node() -> None:
    """On the scheduler stand-in: the dedicated node takes the flavor's pod and refuses a
    foreign GPU pod (even one tolerating the GPU taint), which binds on the shared node."""
    cfg = make_config(flavors=dedicated_flavors())
    plan = build_workload(gang_dispatch(replicas=1), cfg.flavors[0], "muster-workloads", config=cfg)
    (job,) = [o.body for o in plan.objects if o.body["kind"] == "Job"]
    template = job["spec"]["template"]
    assert TAINT | {"operator": "Equal"} in template["spec"]["tolerations"]
    ours = pods_from_template(template, 1, "ours")
    node_sel = template["spec"].get("nodeSelector") or {}
    dedicated = make_node("n1", labels=node_sel, taints=[TAINT])  # the node it is pinned to
    foreign = pods_from_template(
        {
            "spec": {
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                "containers": [
                    {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "8"}}},
                ],
            }
        },
        1,
        "other",
    )
    bound = schedule([dedicated], foreign + ours)
    placed = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in bound}
    assert placed == {"ours-0": "n1", "other-0": None}


def test_a_flavor_without_the_taint_adds_no_toleration() -> None:
    cfg = make_config()
    plan = build_workload(gang_dispatch(replicas=1), cfg.flavors[1], "muster-workloads", config=cfg)
    (job,) = [o.body for o in plan.objects if o.body["kind"] == "Job"]
    tolerations = job["spec"]["template"]["spec"].get("tolerations") or []
    assert all(t.get("key") != "muster.dev/dedicated" for t in tolerations)


@pytest.mark.parametrize("key", ["nvidia.com/gpu", "dedicated"])
def test_an_extended_resource_or_bare_key_is_refused_with_the_reason(key: str) -> None:
    with pytest.raises(KubeConfigError, match="ExtendedResourceToleration"):
        make_config(flavors=dedicated_flavors(key=key))


async def test_a_gang_pulling_its_image_stays_created_for_the_brokers_start_limit(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """Pods still pulling (Pending, ContainerCreating, even ImagePullBackOff) are not a
    failure here: the attempt stays `created`, and the broker's start limit (start_s +
    image_pull_s, broker/core/starts.py) alone decides when it took too long."""
    apiserver.put(NODES, node("n1"))
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch(replicas=1))
    pulling = run_job_pod(apiserver, "job-1-a1-worker", "n1", phase="Pending")
    for reason in ("ContainerCreating", "ErrImagePull", "ImagePullBackOff"):
        pulling = copy.deepcopy(pulling)
        pulling["status"] = {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "worker",
                    "ready": False,
                    "restartCount": 0,
                    "image": "trainer:1",
                    "imageID": "",
                    "state": {"waiting": {"reason": reason}},
                }
            ],
        }
        apiserver.put(PODS, pulling)
        await caught_up(apiserver, backend)
    assert [s.phase for s in rec.of(WorkloadStatus)] == ["created"]


def test_shipped_deploy_allows_for_image_pulls_and_tolerates_its_dedicated_pools() -> None:
    broker = parse_config(configmap_data("muster-broker-config", "broker.yaml"), source="deploy")
    timeouts = broker.config.timeouts
    assert timeouts.image_pull_s >= 600  # a 10-20 GB image on a fresh node
    agent = convert_agent_config(
        yaml.safe_load(configmap_data("muster-agent-config", "agent.yaml"))
    )
    flavors = KubeBackend.from_config(agent.cluster, agent.kube or {}).config.flavors
    assert all(f.dedicated_taint is not None for f in flavors)
