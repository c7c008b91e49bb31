"""Partial admission end to end: a 20-pod job that may start with 5 runs with the 9 its
queue's quota allows, and says so in its admitted event."""

from __future__ import annotations

import msgspec

from schemas.config import FlavorQuota, QueueConfig, ResourceQuota
from tests.e2e.conftest import World, flavor, sim_job


async def test_twenty_pods_with_min_five_run_as_nine_on_a_nine_cpu_queue(world: World) -> None:
    h = world.harness
    quota = FlavorQuota(
        flavor="cpu-od", resources={"cpu": ResourceQuota(nominal=9000), "gpu": ResourceQuota(0)}
    )
    h.config = msgspec.structs.replace(
        h.config, queues=[*h.config.queues, QueueConfig(name="small", quotas=[quota])]
    )
    fleet = await world.start({"c1": [flavor("cpu-od", "on-demand", nodes=2)]})
    job = sim_job("wide", replicas=20, gpu=0, steps=40)
    job["gang"][0].update(cpu="1", memory="1Gi", min_replicas=5)
    reply = await h.submit(job, queue="small")
    assert reply.accepted, reply
    admitted = await h.wait_event(reply.job_id, "admitted", timeout=15)
    assert admitted.reason is not None
    assert admitted.reason.startswith("admitted 9 of 20 pods (min 5): queue small needs 20 cpu")
    await h.wait_event(reply.job_id, "running", timeout=15)
    (attempt,) = fleet.history(reply.job_id)
    assert len(attempt.pods) == 9  # one pod per admitted replica
    await h.wait_event(reply.job_id, "succeeded", timeout=30)
