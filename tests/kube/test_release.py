"""A finished attempt frees its GPUs at once: pods that still run are deleted when the attempt
succeeds or fails; finished pods, and so their logs, stay."""

from __future__ import annotations

import copy
from typing import Any

from schemas.agent import WorkloadStatus
from tests.kube.conftest import NS, PODS, gang_dispatch, node
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.test_backend import JOBS, job_pods, set_pod
from tests.support import wait_for


async def test_a_succeeded_attempt_deletes_its_running_pods_and_keeps_finished_ones(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    for n in ("n1", "n2"):
        apiserver.put("/api/v1/nodes", node(n))
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch(job_id="done", attempt=1))
    done, still = job_pods(apiserver, "done-a1-worker", "Running", ("n1", "n2"))
    await rec.wait_for(lambda: any(e.phase == "running" for e in rec.of(WorkloadStatus)))
    apiserver.pod_logs[(NS, done["metadata"]["name"])] = "step 100 saved\n"
    set_pod(apiserver, done, phase="Succeeded")
    # The Job's own verdict: complete, while one replica still holds its GPUs.
    job = copy.deepcopy(apiserver.get(f"{JOBS}/done-a1-worker"))
    assert job is not None
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    apiserver.put(JOBS, job)
    await rec.wait_for(lambda: any(e.phase == "succeeded" for e in rec.of(WorkloadStatus)))
    still_path = f"{PODS}/{still['metadata']['name']}"

    def released() -> bool:
        p = apiserver.get(still_path)
        return p is None or bool(p["metadata"].get("deletionTimestamp"))

    await wait_for(released, 5, what="the running replica deleted")
    kept = apiserver.get(f"{PODS}/{done['metadata']['name']}")
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    assert (f"{PODS}/{done['metadata']['name']}", "Background") not in apiserver.deletes
    assert apiserver.get(f"{JOBS}/done-a1-worker") is not None  # verdict and TTL unchanged
    logs = await backend.rest.request("GET", f"{PODS}/{done['metadata']['name']}/log")
    assert logs == b"step 100 saved\n"


async def test_releasing_can_be_turned_off(apiserver: FakeApiServer, make_backend: Any) -> None:
    for n in ("n1", "n2"):
        apiserver.put("/api/v1/nodes", node(n))
    backend, rec = await make_backend(release_finished_pods=False)
    await backend.dispatch(gang_dispatch(job_id="keep", attempt=1))
    done, _ = job_pods(apiserver, "keep-a1-worker", "Running", ("n1", "n2"))
    set_pod(apiserver, done, phase="Succeeded")
    job = copy.deepcopy(apiserver.get(f"{JOBS}/keep-a1-worker"))
    assert job is not None
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    apiserver.put(JOBS, job)
    await rec.wait_for(lambda: any(e.phase == "succeeded" for e in rec.of(WorkloadStatus)))
    await wait_for(lambda: not backend._background, 5, what="background work done")
    assert not [p for p, _ in apiserver.deletes if "/pods/" in p]
