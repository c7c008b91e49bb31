"""The cluster-side fence on Kubernetes: a batch Job's activeDeadlineSeconds carries the
broker-granted fence. The healthy agent moves it forward; a hung agent stops moving it and the
Job controller (modelled by the stand-in API server) ends the pods without the agent."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from agents.kube.fence import PATCH_STEP_S, job_start
from agents.runtime import AgentRuntime
from kinds.batch import ANN_FENCE_DEADLINE
from schemas.agent import Dispatch, WorkloadStatus
from tests.kube.conftest import NOW, NS, PODS, Clock, gang_dispatch, manifest_dispatch, run_job_pod
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.test_manifests import PYTORCHJOB_YAML

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
JOB = f"{JOBS}/job-1-a1-worker"
FENCE_AFTER_S = 20.0


def fenced_dispatch() -> Dispatch:
    return msgspec.structs.replace(gang_dispatch(), fence_after_s=FENCE_AFTER_S)


async def fenced_attempt(apiserver: FakeApiServer, make_backend: Any) -> tuple[Clock, Any, Any]:
    """A fenced indexed-job dispatched on a cluster whose Job controller runs on a test clock."""
    clock = Clock()
    apiserver.run_job_controller(clock)
    backend, rec = await make_backend(clock=clock)
    await backend.dispatch(fenced_dispatch())
    return clock, backend, rec


def deadline(server: FakeApiServer) -> int:
    job = server.get(JOB)
    assert job is not None
    return int(job["spec"]["activeDeadlineSeconds"])


async def started(backend: Any, rec: Any) -> None:
    """Wait until the agent's watch has seen the Job's start (the controller's first sync)."""

    def seen() -> bool:
        jobs = backend._attempt_jobs(("job-1", 1))
        return bool(jobs) and job_start(jobs[0][1].status) is not None

    await rec.wait_for(seen)


async def test_a_hung_agents_job_is_ended_by_the_job_controller(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    clock, backend, rec = await fenced_attempt(apiserver, make_backend)
    # Created with the fence as granted at dispatch, counted from the Job's start.
    assert deadline(apiserver) == int(FENCE_AFTER_S)
    job = apiserver.get(JOB)
    assert job is not None and job["metadata"]["annotations"][ANN_FENCE_DEADLINE] == "20"
    pods = [run_job_pod(apiserver, "job-1-a1-worker", f"n{i}", i) for i in (1, 2)]
    await started(backend, rec)
    assert backend.fences("job-1", 1)

    # Healthy: each acknowledgement extends the fence; the Job follows once it grew a step.
    await backend.fence("job-1", 1, NOW + FENCE_AFTER_S + 1)
    assert deadline(apiserver) == 20  # not a step yet: no PATCH
    clock.advance(10)
    await backend.fence("job-1", 1, clock.now + FENCE_AFTER_S)
    assert deadline(apiserver) == 30
    job = apiserver.get(JOB)
    assert job is not None and job["metadata"]["annotations"][ANN_FENCE_DEADLINE] == "30"

    # Hung: no more extensions. Just before the deadline the pods still run ...
    clock.advance(19.5)
    passes = apiserver.job_controller_passes
    await rec.wait_for(lambda: apiserver.job_controller_passes >= passes + 2)
    assert all(apiserver.get(f"{PODS}/{p['metadata']['name']}") for p in pods)
    # ... at it, the Job controller fails the Job and deletes them, without the agent.
    clock.advance(0.5)
    await rec.wait_for(
        lambda: any(
            c["type"] == "Failed" and c["reason"] == "DeadlineExceeded"
            for c in (apiserver.get(JOB) or {}).get("status", {}).get("conditions", [])
        )
    )
    for p in pods:
        gone = apiserver.get(f"{PODS}/{p['metadata']['name']}")
        assert gone is None or gone["metadata"].get("deletionTimestamp")
    # The agent thaws: extending a lapsed fence changes nothing.
    patches = len(apiserver.patches)
    await backend.fence("job-1", 1, clock.now + FENCE_AFTER_S)
    assert len(apiserver.patches) == patches and deadline(apiserver) == 30
    # The Job's verdict reaches the broker as the attempt's end.
    await rec.wait_for(lambda: any(s.phase == "failed" for s in rec.of(WorkloadStatus)))


async def test_a_restarted_agent_takes_up_the_fence_from_the_annotations(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    clock, first, _ = await fenced_attempt(apiserver, make_backend)
    await first.stop()
    clock.advance(10)
    backend, rec = await make_backend(clock=clock)
    await started(backend, rec)
    assert backend.fence_after("job-1", 1) == FENCE_AFTER_S
    await rec.wait_for(lambda: ("job-1", 1) in backend._workloads)
    assert backend.fences("job-1", 1)
    await backend.fence("job-1", 1, clock.now + FENCE_AFTER_S)
    assert deadline(apiserver) == 30


async def test_operator_kinds_keep_the_agents_self_fence(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """A PyTorchJob's pods come from the operator's templates: no field the agent could move
    fences them, so the cluster does not, and the agent's self-fence stays in force."""
    backend, _ = await make_backend()
    cmd = msgspec.structs.replace(manifest_dispatch(PYTORCHJOB_YAML), fence_after_s=20.0)
    await backend.dispatch(cmd)
    assert not backend.fences(cmd.job_id, cmd.attempt)
    patches = len(apiserver.patches)
    await backend.fence(cmd.job_id, cmd.attempt, NOW + 60)
    assert len(apiserver.patches) == patches

    # The runtime asks the backend per attempt, and self-fences this one when cut off.
    runtime = SimpleNamespace(backend=backend)
    assert not AgentRuntime._cluster_fences(runtime, cmd.job_id, cmd.attempt)  # type: ignore[arg-type]


async def test_the_stand_in_refuses_what_a_real_api_server_refuses(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """Why the fence lives on the Job: a pod's activeDeadlineSeconds may only go down, and a
    Job's pod template is immutable. The Job's own field may move both ways."""
    backend, _ = await make_backend()
    await backend.dispatch(fenced_dispatch())
    p = run_job_pod(apiserver, "job-1-a1-worker", "n1")
    p_path = f"{PODS}/{p['metadata']['name']}"
    rest = backend.rest
    await rest.merge_patch(p_path, {"spec": {"activeDeadlineSeconds": 100}})  # set: allowed
    await rest.merge_patch(p_path, {"spec": {"activeDeadlineSeconds": 50}})  # lower: allowed
    with pytest.raises(Exception, match="must be less than or equal to previous value"):
        await rest.merge_patch(p_path, {"spec": {"activeDeadlineSeconds": 60}})
    with pytest.raises(Exception, match="must not update from a positive integer to nil"):
        await rest.merge_patch(p_path, {"spec": {"activeDeadlineSeconds": None}})
    with pytest.raises(Exception, match=r"spec\.template"):
        await rest.merge_patch(JOB, {"spec": {"template": {"spec": {"activeDeadlineSeconds": 60}}}})
    assert all(b["code"] == 422 for b in apiserver.rejected) and len(apiserver.rejected) == 3
    await rest.merge_patch(JOB, {"spec": {"activeDeadlineSeconds": 3600}})
    await rest.merge_patch(JOB, {"spec": {"activeDeadlineSeconds": 60}})
    assert deadline(apiserver) == 60
    assert PATCH_STEP_S < FENCE_AFTER_S
