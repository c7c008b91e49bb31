"""What the kube backend tests share: the pods the Job controller and the scheduler would make
for an Indexed Job (the stand-in API server runs no controllers), a pod's status changed, and
the node upserts the agent reported."""

from __future__ import annotations

import copy
from typing import Any

from schemas.agent import NodeUpsert
from tests.kube.conftest import NS, PODS, Recorder, job_owner, pod
from tests.kube.fake_apiserver import FakeApiServer

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


def upserts(rec: Recorder, name: str) -> list[Any]:
    return [e.node for e in rec.of(NodeUpsert) if e.node.name == name]


def job_pods(
    server: FakeApiServer, job_name: str, phase: str = "Pending", nodes: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """What the Job controller and the scheduler would create for an Indexed Job."""
    job = server.get(f"{JOBS}/{job_name}")
    assert job is not None
    tmpl = job["spec"]["template"]
    out = []
    for i in range(job["spec"]["completions"]):
        p = pod(f"{job_name}-{i}-x", nodes[i] if nodes else "", namespace=NS, gpu=4, phase=phase)
        p["metadata"]["labels"] = copy.deepcopy(tmpl["metadata"]["labels"])
        p["metadata"]["annotations"] = copy.deepcopy(tmpl["metadata"]["annotations"])
        p["metadata"]["ownerReferences"] = [job_owner(job)]
        out.append(server.put(PODS, p))
    return out


def set_pod(server: FakeApiServer, obj: dict[str, Any], **status: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["status"].update(status)
    return server.put(PODS, obj)
