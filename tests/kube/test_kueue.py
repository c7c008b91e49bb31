"""Side by side with Kueue: what the agent creates is never left suspended for Kueue, nor
handed to another controller; the shipped namespace label keeps Kueue's webhook off."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from agents.backend import BackendError
from kinds.base import KindError
from kinds.registry import adapter_of
from schemas.agent import WorkloadStatus
from tests.kube.conftest import NODES, NS, manifest_dispatch, node, run_job_pod
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.kueue_model import suspended
from tests.support import DEPLOY

# Kueue's own sample, kubernetes-sigs/kueue site/static/examples/jobs/sample-job.yaml
# (Apache-2.0), as published.
KUEUE_SAMPLE_JOB = """
apiVersion: batch/v1
kind: Job
metadata:
  generateName: sample-job-
  namespace: default
  labels:
    kueue.x-k8s.io/queue-name: user-queue
spec:
  parallelism: 3
  completions: 3
  suspend: true
  template:
    spec:
      containers:
      - name: dummy-job
        image: registry.k8s.io/e2e-test-images/agnhost:2.53
        args: ["entrypoint-tester", "hello", "world"]
        resources:
          requests:
            cpu: 1
            memory: "200Mi"
      restartPolicy: Never
"""
# Kueue with manageJobsWithoutQueueName, configured as docs/kubernetes.md says.
SELECTOR = "!muster.dev/scheduler"


def shipped_namespace() -> dict[str, Any]:
    docs = yaml.safe_load_all((DEPLOY / "agent" / "namespace.yaml").read_text())
    return next(d for d in docs if d["metadata"]["name"] == NS)


async def test_kueues_sample_job_runs_on_the_stand_in_with_kueue_installed(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.kueue_namespace_selector = SELECTOR
    apiserver.put("/api/v1/namespaces", shipped_namespace())
    apiserver.put(NODES, node("n1"))
    backend, rec = await make_backend()
    await backend.dispatch(manifest_dispatch(KUEUE_SAMPLE_JOB, {"worker": ["n1"]}, job_id="k-1"))
    res = ("batch/v1", "jobs")
    (job,) = apiserver.store[res].values()
    # Not suspended, by the author or by Kueue's webhook, and no Kueue labels.
    assert not suspended(res, job) and "suspend" not in job["spec"]
    assert not any(k.startswith("kueue.x-k8s.io/") for k in job["metadata"]["labels"])
    # The Job controller starts its pods: the attempt runs.
    for i in range(3):
        run_job_pod(apiserver, job["metadata"]["name"], "n1", index=i)
    await rec.wait_for(lambda: any(s.phase == "running" for s in rec.of(WorkloadStatus)))


async def test_without_the_namespace_label_kueue_suspends_what_muster_creates(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """The stand-in's Kueue model bites: the label is what keeps Kueue off."""
    apiserver.kueue_namespace_selector = SELECTOR
    bare = shipped_namespace()
    del bare["metadata"]["labels"]["muster.dev/scheduler"]
    apiserver.put("/api/v1/namespaces", bare)
    apiserver.put(NODES, node("n1"))
    backend, _ = await make_backend()
    await backend.dispatch(manifest_dispatch(KUEUE_SAMPLE_JOB, {"worker": ["n1"]}, job_id="k-2"))
    (job,) = apiserver.store[("batch/v1", "jobs")].values()
    assert suspended(("batch/v1", "jobs"), job)


def _manifest(kind_yaml: str) -> dict[str, Any]:
    return yaml.safe_load(kind_yaml)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (
            "apiVersion: jobset.x-k8s.io/v1alpha2\nkind: JobSet\nmetadata: {name: js}\n"
            "spec: {suspend: true, managedBy: kueue.x-k8s.io/multikueue}",
            ("spec",),
        ),
        (
            "apiVersion: ray.io/v1\nkind: RayJob\nmetadata: {name: r}\n"
            "spec: {suspend: true, managedBy: ray.io/kuberay-operator}",
            ("spec",),
        ),
        (
            "apiVersion: kubeflow.org/v1\nkind: PyTorchJob\nmetadata: {name: p}\n"
            "spec: {runPolicy: {suspend: true, managedBy: kueue.x-k8s.io/multikueue}}",
            ("spec", "runPolicy"),
        ),
        (
            "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j}\n"
            "spec: {suspend: true, managedBy: kubernetes.io/job-controller}",
            ("spec",),
        ),
    ],
)
def test_suspend_and_a_kueue_or_own_managed_by_are_cleared(text: str, path: tuple[str]) -> None:
    manifest = _manifest(text)
    adapter_of(manifest).take_control(manifest)
    holder: Any = manifest
    for key in path:
        holder = holder[key]
    assert "suspend" not in holder and "managedBy" not in holder


def test_a_managed_by_of_another_controller_is_refused_with_the_field() -> None:
    manifest = _manifest(
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j}\n"
        "spec: {managedBy: example.com/my-controller}"
    )
    with pytest.raises(KindError, match=r"spec.managedBy: 'example.com/my-controller' hands"):
        adapter_of(manifest).take_control(manifest)


async def test_the_agent_refuses_a_job_for_another_controller(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    backend, _ = await make_backend()
    text = KUEUE_SAMPLE_JOB.replace("  suspend: true", "  managedBy: example.com/other")
    with pytest.raises(BackendError, match=r"remove spec\.managedBy"):
        await backend.dispatch(manifest_dispatch(text, {"worker": ["n1"]}, job_id="k-3"))
    assert apiserver.store.get(("batch/v1", "jobs"), {}) == {}
