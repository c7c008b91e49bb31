"""The cluster-side fence on Kubernetes: one Lease per cluster, renewed while the broker hears
the agent, written as a real API server accepts it, adopted by a restarted agent; no object
of an attempt is ever patched for the fence."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client

from agents.kube.fence import (
    ANN_FENCE_UNTIL,
    ANN_FENCED,
    ClusterFence,
    KLease,
    LeaseMeta,
    LeaseSpec,
    lease_path,
    lease_until,
    micro_time,
)
from agents.runtime import AgentRuntime
from schemas.agent import Applied, Dispatch
from tests.kube.conftest import NOW, NS, PODS, Clock, gang_dispatch, manifest_dispatch, run_job_pod
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.manifests import PYTORCHJOB_YAML

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
JOB = f"{JOBS}/job-1-a1-worker"
LEASE = lease_path(NS)
WINDOW_S = 900.0


def fenced_dispatch(job_id: str = "job-1") -> Dispatch:
    return msgspec.structs.replace(gang_dispatch(job_id), fence_after_s=WINDOW_S)


def lease_of(server: FakeApiServer) -> dict[str, Any]:
    lease = server.get(LEASE)
    assert lease is not None, "no fence Lease"
    return lease


async def test_a_dispatch_creates_the_lease_before_its_objects(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock)
    await backend.dispatch(fenced_dispatch())
    lease = lease_of(apiserver)
    assert lease["spec"]["leaseDurationSeconds"] == int(WINDOW_S)
    assert lease["spec"]["holderIdentity"] == "muster-agent/c1"
    assert lease["metadata"]["annotations"][ANN_FENCE_UNTIL] == f"{NOW + WINDOW_S:.3f}"
    posts = [p for m, p, _ in apiserver.requests if m == "POST"]
    assert posts[0].endswith("/leases")  # before any workload object
    job = apiserver.get(JOB)
    assert job is not None and job["metadata"]["annotations"][ANN_FENCED] == "cluster"
    assert "activeDeadlineSeconds" not in job["spec"]  # nothing per object moves
    assert apiserver.rejected == []


async def test_a_later_dispatch_does_not_move_the_lease_from_its_own_arrival(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """The Lease moves when the broker is proven to hear the agent (its Applied), not when a
    Dispatch arrives: one read late (the agent was frozen with it) says nothing of that."""
    clock = Clock()
    backend, _ = await make_backend(clock=clock)
    await backend.dispatch(fenced_dispatch("job-1"))
    first = lease_of(apiserver)["metadata"]["annotations"][ANN_FENCE_UNTIL]
    assert first == f"{NOW + WINDOW_S:.3f}"
    clock.advance(300)
    await backend.dispatch(fenced_dispatch("job-2"))
    assert apiserver.get(f"{JOBS}/job-2-a1-worker") is not None
    assert lease_of(apiserver)["metadata"]["annotations"][ANN_FENCE_UNTIL] == first


async def test_the_runtime_renews_the_lease_for_a_dispatch_from_what_the_broker_heard(
    apiserver: FakeApiServer, make_backend: Any, nc: Client
) -> None:
    """Through the agent's runtime: a Dispatch read 600 s after the broker last acknowledged
    this agent (within the 900 s window) starts, and the Lease then runs to that moment plus
    the window, not to the Dispatch's arrival plus the window."""
    now = time.time()
    clock = Clock(now - 800)
    backend, _ = await make_backend(clock=clock)
    runtime = AgentRuntime(backend, nc)
    runtime.instance = "agent-1"
    heard = now - 600
    await runtime.acknowledged(Applied(epoch=1, instance="agent-1", seq=1), heard)
    for job in ("job-1", "job-2"):
        assert (await runtime.carry_out(fenced_dispatch(job))).ok
        assert apiserver.get(f"{JOBS}/{job}-a1-worker") is not None
        until = float(lease_of(apiserver)["metadata"]["annotations"][ANN_FENCE_UNTIL])
        assert until == pytest.approx(heard + WINDOW_S, abs=0.01), job


async def test_renewals_write_the_one_lease_once_per_step(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock)
    for i in range(5):
        await backend.dispatch(fenced_dispatch(f"job-{i}"))
    step = backend.fence_state.step_s
    before = len(apiserver.patches)
    await backend.renew_fence(NOW + step / 2)  # grew less than a step: no write
    assert len(apiserver.patches) == before
    clock.advance(step)
    await backend.renew_fence(clock.now)
    assert [p for p, _, _ in apiserver.patches[before:]] == [LEASE]
    until = lease_until(msgspec.convert(lease_of(apiserver), KLease))
    assert until == pytest.approx(clock.now + WINDOW_S, abs=0.01)
    # Deleted under the agent (an operator's mistake): the next renewal creates it again.
    apiserver.remove(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/muster-fence")
    clock.advance(step)
    await backend.renew_fence(clock.now)
    clock.advance(step)
    await backend.renew_fence(clock.now)
    assert lease_of(apiserver)["metadata"]["annotations"][ANN_FENCE_UNTIL] == (
        f"{clock.now + WINDOW_S:.3f}"
    )
    assert apiserver.rejected == []


@pytest.mark.parametrize("manifest", ["indexed-job", PYTORCHJOB_YAML], ids=["job", "pytorchjob"])
async def test_a_restarted_agent_adopts_the_window_from_the_lease(
    apiserver: FakeApiServer, make_backend: Any, manifest: str
) -> None:
    clock = Clock()
    first, _ = await make_backend(clock=clock, fence_watchdog=True)
    cmd = (
        fenced_dispatch()
        if manifest == "indexed-job"
        else msgspec.structs.replace(
            manifest_dispatch(manifest, job_id="job-1", attempt=1), fence_after_s=WINDOW_S
        )
    )
    await first.dispatch(cmd)
    await first.stop()
    clock.advance(120)
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    assert backend.fence_after("job-1", cmd.attempt) == WINDOW_S
    assert backend.fences("job-1", cmd.attempt)
    await backend.renew_fence(clock.now)
    assert lease_of(apiserver)["metadata"]["annotations"][ANN_FENCE_UNTIL] == (
        f"{clock.now + WINDOW_S:.3f}"
    )


async def test_without_the_watchdog_the_agent_keeps_its_self_fence(
    apiserver: FakeApiServer, make_backend: Any, nc: Client
) -> None:
    """The Lease alone stops nothing: without a watchdog the runtime self-fences."""
    backend, _ = await make_backend()
    cmd = msgspec.structs.replace(manifest_dispatch(PYTORCHJOB_YAML), fence_after_s=WINDOW_S)
    await backend.dispatch(cmd)
    assert not backend.fences(cmd.job_id, cmd.attempt)
    assert not AgentRuntime(backend, nc).cluster_fences(cmd.job_id, cmd.attempt)


async def test_an_unfenced_dispatch_writes_no_lease(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, _ = await make_backend(fence_watchdog=True)
    await backend.dispatch(gang_dispatch())
    await backend.renew_fence(NOW + 100)
    assert apiserver.get(LEASE) is None
    job = apiserver.get(JOB)
    assert job is not None and ANN_FENCED not in job["metadata"]["annotations"]
    assert not backend.fences("job-1", 1)


def test_the_step_is_a_fortieth_of_the_window_within_bounds() -> None:
    fence = ClusterFence(lambda: NOW)
    fence.granted(900)
    assert fence.step_s == 22.5
    fence.granted(60)
    assert fence.step_s == 5.0
    fence.granted(86_400)
    assert fence.step_s == 30.0


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False), st.integers(1, 86_400))
def test_micro_time_round_trips_within_a_microsecond(renewed: float, duration: int) -> None:
    lease = KLease(LeaseMeta(), LeaseSpec("h", duration, micro_time(renewed)))
    until = lease_until(lease)
    assert until is not None and abs(until - (renewed + duration)) < 1e-5 * max(1, renewed / 1e9)


async def test_the_stand_in_refuses_what_a_real_api_server_refuses(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """Why no per-object fence: a pod's activeDeadlineSeconds may only go down, and a Job's
    pod template is immutable; moving a field on every object costs a write per object."""
    backend, _ = await make_backend()
    await backend.dispatch(fenced_dispatch())
    p = run_job_pod(apiserver, "job-1-a1-worker", "n1")
    p_path = f"{PODS}/{p['metadata']['name']}"
    rest = backend.rest
    apiserver.authorizer = None  # what validation refuses, for a client allowed to patch Jobs
    await rest.merge_patch(p_path, {"spec": {"activeDeadlineSeconds": 100}})  # set: allowed
    await rest.merge_patch(p_path, {"spec": {"activeDeadlineSeconds": 50}})  # lower: allowed
    with pytest.raises(Exception, match="must be less than or equal to previous value"):
        await rest.merge_patch(p_path, {"spec": {"activeDeadlineSeconds": 60}})
    with pytest.raises(Exception, match=r"spec\.template"):
        await rest.merge_patch(JOB, {"spec": {"template": {"spec": {"activeDeadlineSeconds": 60}}}})
