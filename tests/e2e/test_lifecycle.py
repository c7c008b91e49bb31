"""Issue 4 end to end: submit → dispatched → every replica running → succeeded; cancel; an
agent restart that reconciles instead of re-running."""

from __future__ import annotations

from agents.runtime import AgentRuntime
from tests.world import World, flavor, sim_job


async def test_submit_runs_whole_gang_to_success(world: World) -> None:
    fleet = await world.start({"c1": [flavor("a100-od", "on-demand", nodes=3)]})
    h = world.harness
    reply = await h.submit(sim_job("gang", replicas=3, gpu=8, steps=60))
    assert reply.accepted
    job_id = reply.job_id
    running = await h.wait_event(job_id, "running", timeout=15)
    assert running.cluster == "c1" and running.flavor == "a100-od"
    await h.wait_event(job_id, "succeeded", timeout=20)
    (attempt,) = fleet.history(job_id)
    assert attempt.end_phase == "succeeded" and attempt.last_step == 60
    assert sorted(attempt.nodes) == sorted(fleet["c1"].nodes)  # one replica per node
    assert h.kinds(job_id)[0] == "queued" and h.kinds(job_id)[-1] == "succeeded"
    view = await world.job(job_id)
    assert view["accounting"]["gpu_seconds_used"] > 0
    assert world.max_live_copies[job_id] == 1


async def test_cancel_deletes_the_workload(world: World) -> None:
    fleet = await world.start({"c1": [flavor("a100-od", "on-demand", nodes=1)]})
    h = world.harness
    job_id = (await h.submit(sim_job("long", steps=100_000))).job_id
    await h.wait_event(job_id, "running", timeout=15)
    reply = await h.api("cancel", {"job_id": job_id, "reason": "user changed their mind"})
    assert reply["ok"] and reply["result"]["state"] == "cancelled"
    await h.wait_for(lambda: not fleet.live_copies(job_id), 10)
    assert fleet.history(job_id)[-1].end_phase == "cancelled"
    again = await h.api("cancel", {"job_id": job_id})
    assert not again["ok"] and "already cancelled" in again["error"]


async def test_agent_restart_reconciles_without_rerunning(world: World) -> None:
    fleet = await world.start({"c1": [flavor("a100-od", "on-demand", nodes=2)]})
    h = world.harness
    job_id = (await h.submit(sim_job("steady", steps=200))).job_id
    await h.wait_event(job_id, "running", timeout=15)
    old = fleet.runtimes["c1"]
    await old.stop()
    # A new agent process for the same cluster: new instance id, full snapshot with workloads.
    new = AgentRuntime(fleet["c1"], h.nc, subjects=h.subjects, heartbeat_s=0.2)
    fleet.runtimes["c1"] = new
    await new.start()
    assert new.instance != old.instance
    await h.wait_event(job_id, "succeeded", timeout=30)
    assert [r.attempt for r in fleet.history(job_id)] == [1]
    view = await world.job(job_id)
    assert view["accounting"]["attempts"] == 1
