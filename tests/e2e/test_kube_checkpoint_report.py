"""Checkpoints leave a pod by the default route, end to end: the real broker, the real agent
runtime with `KubeBackend` (its report endpoint on loopback), a real nats-server and per
cluster one stand-in API server.

For a batch Job, a PyTorchJob and a JobSet: the test reads the environment of a pod the
kind's controller made from the template the agent wrote, and runs the SDK's report with
exactly that environment (what the container would do). A spot notice moves the job; the next
attempt's pods resume from the reported step. Then the refusals: a guessed token, another
attempt's token, the moved attempt reporting late, an attempt reporting to the wrong agent.
"""

from __future__ import annotations

import asyncio

import pytest
import yaml

from agents import sdk
from agents.kube.backend import KubeBackend
from kinds.base import ANN_CHECKPOINT, ANN_CHECKPOINT_REQUEST
from tests.e2e.kinds_world import EXAMPLES, KubeCluster, run_on_spot
from tests.e2e.kinds_world import kube_world as kube_world  # the fixture, shared
from tests.world import World


def pod_env(cluster: KubeCluster, job_id: str) -> dict[str, str]:
    """The environment of the job's first pod's first container, as the kubelet gives it."""
    pods = sorted(cluster.pods(job_id), key=lambda p: p["metadata"]["name"])
    assert pods, f"no pod of {job_id} on {cluster.name}"
    container = pods[0]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


def report_url(cluster: KubeCluster) -> str:
    backend = cluster.runtime.backend
    assert isinstance(backend, KubeBackend) and backend.report_url is not None
    return backend.report_url


async def report(env: dict[str, str], step: int) -> sdk.Channel:
    """What the training container does: the SDK, built from its environment alone."""
    ck = sdk.Checkpointer(sdk.SdkEnv.from_env(env))
    return await asyncio.to_thread(ck.report_checkpoint, step)


async def refused(env: dict[str, str], step: int) -> tuple[int, str]:
    with pytest.raises(sdk.CheckpointRefused) as info:
        await report(env, step)
    return info.value.status, info.value.reason


@pytest.mark.parametrize("example", ["indexed-job", "pytorchjob", "jobset"])
async def test_a_step_reported_from_the_pod_is_where_the_moved_job_resumes(
    kube_world: tuple[World, dict[str, KubeCluster]], example: str
) -> None:
    world, clusters = kube_world
    h = world.harness
    job_id = f"{example}-ck"
    manifest = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    home, away = await run_on_spot(world, clusters, manifest, job_id)

    env1 = pod_env(home, job_id)
    assert env1["MUSTER_REPORT_URL"] == report_url(home)
    assert env1["MUSTER_ATTEMPT"] == "1" and env1["MUSTER_CHECKPOINT_TOKEN"]
    assert await report(env1, 120) == "http"
    await h.wait_event(job_id, "checkpointed")
    # A guessed token is refused and changes nothing.
    status, why = await refused({**env1, "MUSTER_CHECKPOINT_TOKEN": "guess"}, 130)
    assert status == 403 and f"job {job_id} attempt 1" in why

    # The cloud reclaims the home pool; the agent asks the pods for a checkpoint, and the
    # container answers through the endpoint at step 150.
    home.reclaim_pool()
    await h.wait_event(job_id, "preempting")
    await h.wait_for(
        lambda: all(
            ANN_CHECKPOINT_REQUEST in p["metadata"]["annotations"] for p in home.pods(job_id)
        ),
        5,
    )
    assert await report(env1, 150) == "http"

    admitted = await h.wait_event(job_id, "admitted", count=2)
    assert admitted.cluster == away.name and admitted.resume_from_step == 150
    second = await h.wait_event(job_id, "running", count=2)
    assert second.attempt == 2
    env2 = pod_env(away, job_id)
    assert env2["MUSTER_ATTEMPT"] == "2" and env2["MUSTER_RESUME_STEP"] == "150"
    assert env2["MUSTER_RESUME_FROM"] == f"s3://ckpt/{job_id}/attempt-1/step-150"
    assert env2["MUSTER_REPORT_URL"] == report_url(away)
    assert env2["MUSTER_CHECKPOINT_TOKEN"] != env1["MUSTER_CHECKPOINT_TOKEN"]

    # The moved attempt's late report, to its own agent: the attempt has ended there.
    status, why = await refused(env1, 160)
    assert status == 409 and "cancelled or moved" in why
    # ... and to the agent where the job runs now: not an attempt of that cluster.
    status, why = await refused({**env1, "MUSTER_REPORT_URL": report_url(away)}, 160)
    assert status == 404 and f"attempt 1 does not run on cluster {away.name}" in why
    # The running attempt's report with the old attempt's token.
    stolen = {**env2, "MUSTER_CHECKPOINT_TOKEN": env1["MUSTER_CHECKPOINT_TOKEN"]}
    status, why = await refused(stolen, 170)
    assert status == 403 and f"job {job_id} attempt 2" in why
    view = await world.job(job_id)
    assert view["latest_checkpoint"]["step"] == 150  # no refusal moved it

    # Nothing went by the annotation route: every step came through the endpoint.
    assert not any(ANN_CHECKPOINT in p["metadata"]["annotations"] for p in home.pods(job_id))
    assert await report(env2, 180) == "http"
    await h.wait_for(
        lambda: h.kinds(job_id).count("checkpointed") >= 3, 5
    )  # 120, 150 (attempt 1), 180 (attempt 2)
    away.succeed()
    done = await h.wait_event(job_id, "succeeded")
    assert done.accounting is not None and done.accounting.attempts == 2
    assert home.refused == [] and away.refused == []
