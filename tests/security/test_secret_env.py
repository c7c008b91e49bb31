"""Secrets stay out of JobSpecs: `workload.secret_env` names a Secret key that the kubelet
resolves in the cluster; the pod gets a `valueFrom.secretKeyRef`, never the value. The
attempt's checkpoint token reaches every container. A local cluster, with no Secrets, refuses
such a job rather than run it without its credentials."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from agents.kube.config import build_workload
from schemas.codec import DecodeError, json_decoder
from schemas.job import JobSpec
from tests.kube.conftest import dispatch
from tests.kube.manifests import FLAVOR, NS, templates_of
from tests.kube.validation import validate
from tests.local.conftest import PY, Lab

SPEC: dict[str, Any] = {
    "name": "ddp",
    "job_id": "job-1",
    "gang": [{"name": "worker", "replicas": 2, "gpu": 8}],
    "workload": {
        "image": "trainer:1",
        "env": {"LOG_LEVEL": "info"},
        "secret_env": {"HF_TOKEN": {"name": "hf-credentials", "key": "token"}},
    },
}


def test_secret_env_becomes_a_secret_key_ref_and_the_token_reaches_the_pods() -> None:
    cmd = dispatch(SPEC, {"worker": ["n0", "n1"]}, checkpoint_token="t0k3n")
    plan = build_workload(cmd, FLAVOR, NS)
    for obj in plan.objects:
        assert validate(obj.body) == []
    (job,) = [o.body for o in plan.objects if o.body["kind"] == "Job"]
    (template,) = templates_of(job)
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}},
    }
    assert env["LOG_LEVEL"]["value"] == "info"
    assert env["MUSTER_CHECKPOINT_TOKEN"]["value"] == "t0k3n"


def test_a_bad_secret_reference_is_refused_with_the_field_named() -> None:
    bad = {**SPEC, "workload": {"secret_env": {"X": {"name": "Not_A_Name", "key": "k"}}}}
    with pytest.raises(DecodeError, match="secret_env"):
        json_decoder(JobSpec, "JobSpec")(msgspec.json.encode(bad))


async def test_a_local_cluster_refuses_secret_env_and_runs_nothing(lab: Lab) -> None:
    """The local backend has no Secrets to resolve: the dispatch is refused with the reason,
    no replica starts, and the broker requeues the job as for any refused dispatch."""
    await lab.start()
    h = lab.harness
    spec = {
        "name": "needs-secret",
        "gang": [{"name": "worker", "replicas": 1, "gpu": 1}],
        "workload": {
            "command": [PY, "-c", "print('ran')"],
            "secret_env": {"HF_TOKEN": {"name": "hf-credentials", "key": "token"}},
        },
    }
    job_id = (await h.submit(spec)).job_id
    requeued = await h.wait_event(job_id, "requeued", timeout=15)
    assert requeued.reason is not None
    assert "secret_env needs the kube backend" in requeued.reason
    assert "HF_TOKEN" in requeued.reason
    assert not any(e.kind == "running" for e in h.events[job_id])
    for cluster in ("a", "b"):
        backend = lab.backend(cluster)
        assert backend.live_workloads() == []
        assert not (backend.attempt_dir(job_id, 1) / "state.json").exists()
