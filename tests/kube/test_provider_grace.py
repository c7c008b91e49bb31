"""Each provider's real graceful shutdown on spot pods: set as terminationGracePeriodSeconds
and told to the workload as MUSTER_SIGTERM_GRACE_S (GKE spot cuts any grace to 15 s); and
each signal's own window."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from agents.kube.decode import KNode
from agents.kube.nodes import Rules, notices
from tests.kube.conftest import NODES, NS, gang_dispatch, make_config, manifest_dispatch, node
from tests.kube.fake_apiserver import FakeApiServer

JOB = f"/apis/batch/v1/namespaces/{NS}/jobs/job-1-a1-worker"
PROVIDERS = {
    "aws": ("aws:///us-east-1a/i-", {"karpenter.sh/capacity-type": "spot"}),
    "gcp": ("gce://proj/us-central1-a/", {"cloud.google.com/gke-spot": "true"}),
    "azure": (
        "azure:///subscriptions/s/virtualMachineScaleSets/v/virtualMachines/",
        {"kubernetes.azure.com/scalesetpriority": "spot"},
    ),
}


def _env(pod_spec: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod_spec["containers"][0]["env"]}


@pytest.mark.parametrize(("provider", "grace"), [("aws", 120), ("gcp", 15), ("azure", 30)])
async def test_spot_pods_get_their_providers_grace(
    apiserver: FakeApiServer, make_backend: Any, provider: str, grace: int
) -> None:
    prefix, labels = PROVIDERS[provider]
    for n in ("n1", "n2"):
        apiserver.put(NODES, node(n, labels=labels, provider_id=prefix + n))
    backend, _ = await make_backend()
    await backend.dispatch(gang_dispatch())
    job = apiserver.get(JOB)
    assert job is not None
    spec = job["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == grace
    assert _env(spec)["MUSTER_SIGTERM_GRACE_S"] == str(grace)


async def test_gke_spot_cuts_a_longer_grace_the_workload_asks_for(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    prefix, labels = PROVIDERS["gcp"]
    apiserver.put(NODES, node("n1", labels=labels, provider_id=prefix + "n1"))
    backend, _ = await make_backend()
    text = """
apiVersion: batch/v1
kind: Job
metadata: {name: long}
spec:
  template:
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: 300
      containers: [{name: c, image: i, resources: {limits: {nvidia.com/gpu: 4}}}]
"""
    await backend.dispatch(manifest_dispatch(text, {"long": ["n1"]}))
    (job,) = apiserver.store[("batch/v1", "jobs")].values()
    spec = job["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 300  # the workload's own, kept
    assert _env(spec)["MUSTER_SIGTERM_GRACE_S"] == "15"  # what GKE really gives it


def test_the_gke_termination_taint_is_maintenance_on_an_on_demand_gpu_node() -> None:
    """On a spot node the taint is the preemption (30 s); on an on-demand GPU node it is host
    maintenance, which GKE lets run up to an hour."""
    taint = [{"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}]
    rules = Rules(make_config())
    spot = node("s", labels={"cloud.google.com/gke-spot": "true"}, taints=taint)
    held = node("h", labels={"cloud.google.com/gke-provisioning": "standard"}, taints=taint)
    (preempted,) = notices(msgspec.convert(spot, KNode), rules, "gcp")
    (maintained,) = notices(msgspec.convert(held, KNode), rules, "gcp")
    assert preempted.window_s == 30
    assert maintained.window_s == 3600 and "host maintenance" in maintained.reason
