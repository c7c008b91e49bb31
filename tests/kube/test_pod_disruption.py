"""Pod-level disruption reasons: one pod evicted or ended by the kubelet says nothing about
its node, unless the pod is Muster's own or the node itself carries a signal (a drain is a
cordon plus evictions)."""

from __future__ import annotations

import copy
from typing import Any

from kinds.base import LABEL_JOB
from schemas.agent import SpotNotice
from tests.kube.conftest import NODES, NOW, NS, caught_up, node, pod
from tests.kube.fake_apiserver import FakeApiServer


def evicted(name: str, node_name: str, namespace: str, reason: str, **kw: Any) -> dict[str, Any]:
    cond = {"type": "DisruptionTarget", "status": "True", "reason": reason}
    return pod(name, node_name, namespace, conditions=[cond], **kw)


async def test_a_foreign_eviction_on_a_healthy_node_is_no_notice_until_a_drain(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    raw = node("n1", provider_id="aws:///us-east-1a/i-1")
    apiserver.put(NODES, raw)
    backend, rec = await make_backend()
    # The descheduler evicts one pod, the kubelet ends another for memory pressure.
    apiserver.put(
        "/api/v1/namespaces/team/pods", evicted("d", "n1", "team", "EvictionByEvictionAPI")
    )
    apiserver.put(
        "/api/v1/namespaces/team/pods", evicted("k", "n1", "team", "TerminationByKubelet")
    )
    await caught_up(apiserver, backend)
    assert rec.of(SpotNotice) == []
    # `kubectl drain`: the cordon, then the evictions: the node is going away.
    drained = copy.deepcopy(raw)
    drained["spec"]["unschedulable"] = True
    apiserver.put(NODES, drained)
    await rec.wait_for(lambda: rec.of(SpotNotice))
    (notice,) = rec.of(SpotNotice)
    assert notice.node == "n1" and "EvictionByEvictionAPI" in notice.reason
    assert notice.deadline == NOW + 120


async def test_an_eviction_of_musters_own_pod_is_a_notice(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1", provider_id="aws:///us-east-1a/i-1"))
    _, rec = await make_backend()
    own = evicted("w-0", "n1", NS, "EvictionByEvictionAPI", labels={LABEL_JOB: "job-1"}, gpu=4)
    apiserver.put(f"/api/v1/namespaces/{NS}/pods", own)
    await rec.wait_for(lambda: rec.of(SpotNotice))
    assert "pod w-0: EvictionByEvictionAPI" in rec.of(SpotNotice)[0].reason
