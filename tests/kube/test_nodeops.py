"""`muster cordon|uncordon|drain` on a Kubernetes cluster, against the stand-in API server with
the shipped RBAC: refused with the 403 reason unless the optional node-operations role is
applied; with it, cordon sets `spec.unschedulable` (reported `no_new_pods`), drain evicts
Muster's pods through the Eviction API, and a PodDisruptionBudget with no disruption left
keeps its pod, with the budget's reason."""

from __future__ import annotations

from typing import Any

import pytest

from agents.backend import BackendError
from kinds.base import LABEL_JOB
from schemas.agent import WorkloadStatus
from tests.kube.conftest import NODES, NS, PODS, caught_up, gang_dispatch, node
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.helpers import job_pods, upserts
from tests.kube.rbac_authz import RbacAuthorizer

PDBS = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"


def allow_nodeops(server: FakeApiServer) -> None:
    server.authorizer = RbacAuthorizer.with_optional("nodeops-rbac")


async def running_gang(
    apiserver: FakeApiServer, make_backend: Any
) -> tuple[Any, Any, list[dict[str, Any]]]:
    """The optional role applied, and a 2-node gang of job-1 running on n1 and n2."""
    allow_nodeops(apiserver)
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch())
    pods = job_pods(apiserver, "job-1-a1-worker", "Running", ("n1", "n2"))
    await rec.wait_for(lambda: rec.of(WorkloadStatus)[-1].phase == "running")
    return backend, rec, pods


async def test_without_the_optional_role_the_agent_answers_with_the_403(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    backend, _ = await make_backend()
    with pytest.raises(BackendError) as refused:
        await backend.node_op("cordon", "n1", "")
    text = str(refused.value)
    assert 'cannot patch resource "nodes"' in text and "nodeops-rbac.yaml" in text
    assert not (apiserver.get(f"{NODES}/n1") or {})["spec"].get("unschedulable")


async def test_cordon_and_uncordon_set_unschedulable_and_the_node_report(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    allow_nodeops(apiserver)
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    backend, rec = await make_backend()
    done = await backend.node_op("cordon", "n1", "disk check")
    assert done.nodes == ["n1"] and done.attempts == []
    assert apiserver.get(f"{NODES}/n1")["spec"]["unschedulable"] is True  # type: ignore[index]
    await rec.wait_for(lambda: bool(upserts(rec, "n1")) and upserts(rec, "n1")[-1].no_new_pods)
    assert not (apiserver.get(f"{NODES}/n2") or {})["spec"].get("unschedulable")
    await backend.node_op("uncordon", "n1", "")
    assert apiserver.get(f"{NODES}/n1")["spec"]["unschedulable"] is False  # type: ignore[index]
    await rec.wait_for(lambda: not upserts(rec, "n1")[-1].no_new_pods)
    with pytest.raises(BackendError, match="has no node 'n9'"):
        await backend.node_op("cordon", "n9", "")
    with pytest.raises(BackendError, match="spot notices come from its cloud provider"):
        await backend.node_op("notice", "n1", "")


async def test_drain_evicts_musters_pods_and_their_attempt_ends_evicted(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, rec, pods = await running_gang(apiserver, make_backend)
    done = await backend.node_op("drain", "n1", "kernel upgrade")
    assert done.nodes == ["n1"] and done.attempts == [("job-1", 1)]
    assert apiserver.get(f"{NODES}/n1")["spec"]["unschedulable"] is True  # type: ignore[index]
    evicted = apiserver.get(f"{PODS}/{pods[0]['metadata']['name']}")
    assert evicted is None or evicted["metadata"].get("deletionTimestamp")
    assert apiserver.get(f"{PODS}/{pods[1]['metadata']['name']}") is not None
    await rec.wait_for(lambda: rec.of(WorkloadStatus)[-1].phase == "evicted")
    assert "eviction API" in rec.of(WorkloadStatus)[-1].reason


async def test_a_budget_with_no_disruption_left_keeps_its_pod_with_the_reason(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, rec, pods = await running_gang(apiserver, make_backend)
    apiserver.put(
        PDBS,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "trainers"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {LABEL_JOB: "job-1"}}},
            "status": {"disruptionsAllowed": 0, "desiredHealthy": 2, "currentHealthy": 2},
        },
    )
    with pytest.raises(BackendError) as blocked:
        await backend.node_op("drain", "n1", "")
    text = str(blocked.value)
    assert "would violate the pod's disruption budget" in text
    assert "The disruption budget trainers needs 2 healthy pods and has 2 currently" in text
    assert "n1 cordoned" in text
    kept = apiserver.get(f"{PODS}/{pods[0]['metadata']['name']}")
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    await caught_up(apiserver, backend)
    assert rec.of(WorkloadStatus)[-1].phase == "running"
