"""Secrets stay out of JobSpecs: `workload.secret_env` names a Secret key that the kubelet
resolves in the cluster; the pod gets a `valueFrom.secretKeyRef`, never the value. The
attempt's checkpoint token reaches every container."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from agents.kube.config import build_workload
from schemas.codec import DecodeError, json_decoder
from schemas.job import JobSpec
from tests.kube.conftest import dispatch
from tests.kube.test_manifests import FLAVOR, NS, templates_of
from tests.kube.validation import validate

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
