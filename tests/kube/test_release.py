"""A finished attempt frees its GPUs at once: pods that still run are deleted when the attempt
succeeds or fails; finished pods, and so their logs, stay."""

from __future__ import annotations

import copy
from typing import Any

from agents.kube.backend import KubeBackend
from schemas.agent import WorkloadStatus
from tests.kube.conftest import NS, PODS, Recorder, gang_dispatch, node
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.helpers import JOBS, job_pods, set_pod
from tests.support import wait_for


async def finish(
    apiserver: FakeApiServer, make_backend: Any, job_id: str, **config: Any
) -> tuple[KubeBackend, Recorder, dict[str, Any], dict[str, Any]]:
    """A two-replica attempt whose Job completes while one replica still runs: (backend,
    recorder, the finished pod, the running one)."""
    for n in ("n1", "n2"):
        apiserver.put("/api/v1/nodes", node(n))
    backend, rec = await make_backend(**config)
    await backend.dispatch(gang_dispatch(job_id=job_id, attempt=1))
    done, still = job_pods(apiserver, f"{job_id}-a1-worker", "Running", ("n1", "n2"))
    await rec.wait_for(lambda: any(e.phase == "running" for e in rec.of(WorkloadStatus)))
    apiserver.pod_logs[(NS, done["metadata"]["name"])] = "step 100 saved\n"
    set_pod(apiserver, done, phase="Succeeded")
    job = copy.deepcopy(apiserver.get(f"{JOBS}/{job_id}-a1-worker"))
    assert job is not None
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    apiserver.put(JOBS, job)
    await rec.wait_for(lambda: any(e.phase == "succeeded" for e in rec.of(WorkloadStatus)))
    return backend, rec, done, still


async def test_a_succeeded_attempt_deletes_its_running_pods_and_keeps_finished_ones(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, _, done, still = await finish(apiserver, make_backend, "done")
    still_path = f"{PODS}/{still['metadata']['name']}"

    def released() -> bool:
        p = apiserver.get(still_path)
        return p is None or bool(p["metadata"].get("deletionTimestamp"))

    await wait_for(released, 5, what="the running replica deleted")
    done_path = f"{PODS}/{done['metadata']['name']}"
    kept = apiserver.get(done_path)
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    assert all(path != done_path for path, _ in apiserver.deletes)
    assert apiserver.get(f"{JOBS}/done-a1-worker") is not None  # verdict and TTL unchanged
    assert await backend.rest.request("GET", f"{done_path}/log") == b"step 100 saved\n"


async def test_releasing_can_be_turned_off(apiserver: FakeApiServer, make_backend: Any) -> None:
    backend, _, _, _ = await finish(apiserver, make_backend, "keep", release_finished_pods=False)
    await wait_for(lambda: not backend.background_work, 5, what="background work done")
    assert not [p for p, _ in apiserver.deletes if "/pods/" in p]
