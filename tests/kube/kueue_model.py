"""Kueue's job webhook, as a modelled rule for the API server stand-in: a job Kueue manages is
created suspended, and stays so until Kueue admits it (which the stand-in never does).

Kueue manages a job of an integrated kind when it carries `kueue.x-k8s.io/queue-name`, or when
the Configuration sets `manageJobsWithoutQueueName: true` and the job's namespace matches
`managedJobsNamespaceSelector` (kubernetes-sigs/kueue, Apache-2.0:
`pkg/controller/jobframework/webhook` and KEP 3589 "manage jobs selectively"); its defaulting
webhook then sets the kind's suspend field (`spec.suspend`, Kubeflow `spec.runPolicy.suspend`).
"""

from __future__ import annotations

from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# (group/version, plural) -> the suspend field Kueue's webhook sets
SUSPEND_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("batch/v1", "jobs"): ("spec", "suspend"),
    ("jobset.x-k8s.io/v1alpha2", "jobsets"): ("spec", "suspend"),
    ("ray.io/v1", "rayjobs"): ("spec", "suspend"),
    ("ray.io/v1", "rayclusters"): ("spec", "suspend"),
    ("trainer.kubeflow.org/v1alpha1", "trainjobs"): ("spec", "suspend"),
    **{
        ("kubeflow.org/v1", p): ("spec", "runPolicy", "suspend")
        for p in ("pytorchjobs", "tfjobs", "mpijobs", "xgboostjobs", "paddlejobs", "jaxjobs")
    },
    ("kubeflow.org/v2beta1", "mpijobs"): ("spec", "runPolicy", "suspend"),
}


def suspended(res: tuple[str, str], obj: dict[str, Any]) -> bool:
    """Whether the object's suspend field is set."""
    cur: Any = obj
    for key in SUSPEND_FIELDS.get(res, ("-",)):
        cur = cur.get(key) if isinstance(cur, dict) else None
    return cur is True


def suspend(res: tuple[str, str], obj: dict[str, Any]) -> None:
    cur = obj
    path = SUSPEND_FIELDS[res]
    for key in path[:-1]:
        cur = cur.setdefault(key, {})
    cur[path[-1]] = True
