"""Outcomes that happen while the broker is away reach it once it is back: the agent keeps
them until the broker acknowledges them as persisted, so nothing finished runs twice."""

from __future__ import annotations

from tests.world import World, flavor, sim_job


async def test_job_that_succeeded_while_the_broker_was_down_is_not_run_again(
    world: World,
) -> None:
    fleet = await world.start({"c1": [flavor("a100-od", "on-demand", nodes=2)]})
    h = world.harness
    job_id = (await h.submit(sim_job("quick", steps=120, rate=20.0, every=40))).job_id
    await h.wait_event(job_id, "running", timeout=15)
    await h.crash_broker()
    # The workload finishes with nobody listening: its ending goes nowhere on the wire.
    await h.wait_for(lambda: fleet.history(job_id)[-1].end_phase == "succeeded", 30)
    runtime = fleet.runtimes["c1"]
    assert runtime.outbox_size() >= 1
    await h.start_broker()
    await h.wait_event(job_id, "succeeded", timeout=20)
    assert [r.attempt for r in fleet.history(job_id)] == [1]
    view = await world.job(job_id)
    assert view["state"] == "succeeded" and view["accounting"]["attempts"] == 1
    # Acknowledged once persisted: the agent forgets it.
    await h.wait_for(lambda: runtime.outbox_size() == 0, 10)
    assert world.max_live_copies[job_id] == 1
