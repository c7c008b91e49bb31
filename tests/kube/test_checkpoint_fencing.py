"""The agent takes a checkpoint annotation only from a pod of the attempt it names."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from agents.kube.decode import KPod
from agents.kube.status import Workload
from kinds.base import ANN_CHECKPOINT
from tests.kube.conftest import pod


def _pod(value: dict[str, Any]) -> KPod:
    p = pod("w-0", "n1", annotations={ANN_CHECKPOINT: json.dumps(value)})
    return msgspec.convert(p, KPod)


def test_annotation_naming_another_attempt_or_job_is_ignored() -> None:
    w = Workload("job-1", 2)
    assert w.checkpoint(_pod({"step": 5, "uri": "u", "job_id": "job-1", "attempt": 1})) is None
    assert w.checkpoint(_pod({"step": 5, "uri": "u", "job_id": "job-2", "attempt": 2})) is None
    report = w.checkpoint(_pod({"step": 5, "uri": "u", "job_id": "job-1", "attempt": 2}))
    assert report is not None and (report.job_id, report.attempt, report.step) == ("job-1", 2, 5)
    legacy = w.checkpoint(_pod({"step": 6, "uri": "u"}))  # unnamed: the pod's own attempt
    assert legacy is not None and legacy.attempt == 2
