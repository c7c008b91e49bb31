"""Each provider's real graceful shutdown on spot pods: set as terminationGracePeriodSeconds
and told to the workload as MUSTER_SIGTERM_GRACE_S (GKE spot cuts any grace to 15 s)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.kube.conftest import NODES, NS, gang_dispatch, manifest_dispatch, node
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
