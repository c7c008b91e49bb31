"""Workloads carry a PriorityClass from the job's priority, so kube-scheduler orders them
against the cluster's other pods as the broker orders jobs."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from schemas.agent import Dispatch
from tests.kube.conftest import NODES, NS, gang_dispatch, manifest_dispatch, node
from tests.kube.fake_apiserver import FakeApiServer

CLASSES = [
    {"name": "muster-low", "min_priority": -1_000_000},
    {"name": "muster-normal", "min_priority": 0},
    {"name": "muster-high", "min_priority": 100},
]


def _with_priority(priority: int) -> Dispatch:
    cmd = gang_dispatch()
    spec = msgspec.structs.replace(cmd.spec, priority=priority)
    return msgspec.structs.replace(cmd, spec=spec)


async def _gang_template(
    server: FakeApiServer, make_backend: Any, cmd: Dispatch, **cfg: Any
) -> Any:
    """The pod template of the gang's Job, as the agent created it."""
    for n in ("n1", "n2"):
        server.put(NODES, node(n))
    backend, _ = await make_backend(**cfg)
    await backend.dispatch(cmd)
    job = server.get(f"/apis/batch/v1/namespaces/{NS}/jobs/job-1-a1-worker")
    assert job is not None
    return job["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("priority", "cls"),
    [(-5, "muster-low"), (0, "muster-normal"), (99, "muster-normal"), (500, "muster-high")],
)
async def test_the_pods_priority_class_follows_the_jobs_priority(
    apiserver: FakeApiServer, make_backend: Any, priority: int, cls: str
) -> None:
    cmd = _with_priority(priority)
    spec = await _gang_template(apiserver, make_backend, cmd, priority_classes=CLASSES)
    assert spec["priorityClassName"] == cls


async def test_no_classes_configured_no_class_and_the_authors_own_is_kept(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    spec = await _gang_template(apiserver, make_backend, gang_dispatch())
    assert "priorityClassName" not in spec
    backend, _ = await make_backend(priority_classes=CLASSES)
    text = """
apiVersion: batch/v1
kind: Job
metadata: {name: own}
spec:
  template:
    spec:
      restartPolicy: Never
      priorityClassName: team-critical
      containers: [{name: c, image: i, resources: {limits: {nvidia.com/gpu: 4}}}]
"""
    await backend.dispatch(manifest_dispatch(text, {"own": ["n1"]}, job_id="p-2"))
    (mine,) = [
        j for j in apiserver.store[("batch/v1", "jobs")].values() if "p-2" in str(j["metadata"])
    ]
    assert mine["spec"]["template"]["spec"]["priorityClassName"] == "team-critical"
