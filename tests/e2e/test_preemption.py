"""Spot notices, lost nodes and clusters, fallback to on-demand, a broker crash in the middle
of a recovery, and a correlated reclaim taken from the Bamboo trace, end to end."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from load.traces import default_traces_dir
from tests.support import wait_for
from tests.world import World, flavor, sim_job

TRACES = default_traces_dir()


async def _running_on(world: World, job_id: str, attempt: int = 1) -> tuple[str, list[str]]:
    assert world.fleet is not None
    await world.harness.wait_event(job_id, "running", timeout=15, count=attempt)
    record = world.fleet.history(job_id)[-1]
    return record.cluster, record.nodes


async def _wait_step(world: World, job_id: str, attempt: int, step: int) -> None:
    async def reached() -> bool:
        return await world.step_of(job_id, attempt) >= step

    await wait_for(reached, 30, what=f"{job_id} attempt {attempt} at step {step}")


def _assert_resumed_exactly(world: World, job_id: str) -> None:
    """Each attempt starts from the newest checkpoint the broker heard from the attempt before
    it, one that attempt really saved. The previous copy may save again between the broker's
    decision and its Cancel (under load); that later one is lost work, never a gap."""
    assert world.fleet is not None
    events = world.harness.events[job_id]
    resumed_from = {e.attempt: e.resume_from_step for e in events if e.kind == "admitted"}
    for before, after in itertools.pairwise(world.fleet.history(job_id)):
        heard = [e.step for e in events if e.kind == "checkpointed" and e.attempt == before.attempt]
        resumed = resumed_from[after.attempt]
        assert after.started_from_step == resumed  # the workload starts where the broker said
        assert resumed in before.saved, f"attempt {before.attempt} never saved step {resumed}"
        assert heard and resumed >= max(s for s in heard if s is not None)


async def test_spot_notice_resumes_elsewhere_from_the_checkpointed_step(world: World) -> None:
    fleet = await world.start(
        {"a": [flavor("spot", "spot", nodes=1)], "b": [flavor("spot", "spot", nodes=1, price=1.1)]}
    )
    h = world.harness
    job_id = (await h.submit(sim_job("ft", steps=400, every=20, capacity="spot"))).job_id
    cluster, nodes = await _running_on(world, job_id)
    await _wait_step(world, job_id, 1, 70)
    fleet[cluster].spot_notice(nodes[0], lead_s=120)
    admitted = await h.wait_event(job_id, "admitted", count=2, timeout=15)
    other = "b" if cluster == "a" else "a"
    assert admitted.cluster == other
    first = fleet.history(job_id)[0]
    # CheckpointNow made the workload save its current step, not the last periodic one.
    assert first.last_checkpoint_step is not None and first.last_checkpoint_step >= 70
    done = await h.wait_event(job_id, "succeeded", timeout=40)
    assert done.accounting is not None and done.accounting.preemptions == 1
    assert 0 < done.accounting.goodput < 1 and done.accounting.cost > 0
    _assert_resumed_exactly(world, job_id)
    assert first.end_phase in ("cancelled", "evicted")
    view = await world.job(job_id)
    assert view["accounting"]["preemptions"] == 1
    assert view["attempts"][0]["end_cause"] == "spot-notice"
    assert world.max_live_copies[job_id] == 1


async def test_no_capacity_elsewhere_waits_then_resumes(world: World) -> None:
    fleet = await world.start({"a": [flavor("spot", "spot", nodes=1)]})
    h = world.harness
    job_id = (await h.submit(sim_job("waits", steps=300, capacity="spot"))).job_id
    _, nodes = await _running_on(world, job_id)
    await _wait_step(world, job_id, 1, 50)
    fleet["a"].spot_notice(nodes[0], lead_s=8)
    requeued = await h.wait_event(job_id, "requeued", timeout=15)
    assert requeued.reason == "spot-notice"

    async def considered() -> dict[str, Any] | None:  # a cycle has looked for a place
        why = await h.api("why", {"job_id": job_id})
        codes = [r["code"] for r in why["result"]["reasons"]]
        return why if codes and "not-yet-considered" not in codes else None

    why = await wait_for(considered, 15, what="a cycle's verdict on the requeued job")
    assert why["result"]["state"] == "queued"
    assert h.kinds(job_id).count("admitted") == 1  # nowhere to go yet
    fleet["a"].add_node("spot")  # capacity returns
    admitted = await h.wait_event(job_id, "admitted", count=2, timeout=15)
    assert admitted.resume_from_step and admitted.resume_from_step >= 50
    await h.wait_event(job_id, "succeeded", timeout=40)
    _assert_resumed_exactly(world, job_id)


async def test_spot_then_on_demand_falls_back(world: World) -> None:
    fleet = await world.start(
        {
            "a": [flavor("spot", "spot", nodes=1, price=1.0)],
            "b": [
                flavor("spot", "spot", nodes=1, price=1.0),
                flavor("od", "on-demand", nodes=1, price=3.0),
            ],
        }
    )
    h = world.harness
    spec = sim_job(
        "fallback",
        steps=300,
        capacity="spot-then-on-demand",
        spot={"fallback_after_preemptions": 1},
    )
    job_id = (await h.submit(spec)).job_id
    cluster, nodes = await _running_on(world, job_id)
    assert fleet.history(job_id)[0].flavor == "spot"
    await _wait_step(world, job_id, 1, 40)
    fleet[cluster].spot_notice(nodes[0], lead_s=120)
    admitted = await h.wait_event(job_id, "admitted", count=2, timeout=15)
    assert admitted.flavor == "od"  # the other spot pool was free, but spot is spent
    await h.wait_event(job_id, "succeeded", timeout=40)
    _assert_resumed_exactly(world, job_id)


async def test_gpu_failure_takes_the_same_path_without_warning(world: World) -> None:
    fleet = await world.start({"a": [flavor("od", "on-demand", nodes=2)]})
    h = world.harness
    job_id = (await h.submit(sim_job("xid", steps=300))).job_id
    _, nodes = await _running_on(world, job_id)
    await _wait_step(world, job_id, 1, 45)
    fleet["a"].fail_gpu(nodes[0], count=1, xid=79)
    requeued = await h.wait_event(job_id, "requeued", timeout=15)
    assert "gpu-failure" in (requeued.reason or "")
    _cluster, new_nodes = await _running_on(world, job_id, attempt=2)
    assert new_nodes != nodes  # the node with a failed GPU takes nothing new
    await h.wait_event(job_id, "succeeded", timeout=40)
    _assert_resumed_exactly(world, job_id)
    view = await world.job(job_id)
    assert view["accounting"]["gpu_seconds_lost"] > 0
    assert view["accounting"]["goodput"] < 1.0


@pytest.mark.parametrize("self_fence", [True, False], ids=["agent-self-fences", "broker-fences"])
async def test_partition_never_leaves_two_live_copies(world: World, self_fence: bool) -> None:
    """A cluster is cut off while it runs a job. With self-fencing (the default) its agent
    deletes the attempt before the broker starts the job elsewhere; without it (an agent that
    does not fence) the broker deletes the stale attempt as soon as the partition heals."""
    import msgspec

    h = world.harness
    h.config = msgspec.structs.replace(
        h.config,
        timeouts=msgspec.structs.replace(
            h.config.timeouts, lost_after_s=4.0, fence_lead_s=2.0 if self_fence else 0.0
        ),
    )
    fleet = await world.start(
        {
            "a": [flavor("od", "on-demand", nodes=1)],
            "b": [flavor("od", "on-demand", nodes=1, price=2)],
        }
    )
    job_id = (await h.submit(sim_job("split", steps=800))).job_id
    cluster, _ = await _running_on(world, job_id)
    other = "b" if cluster == "a" else "a"
    await _wait_step(world, job_id, 1, 40)
    copies: list[int] = []

    async def count_copies() -> None:  # including the cluster behind the partition
        for _ in range(2000):
            copies.append(len(fleet.live_copies(job_id)))
            await asyncio.sleep(0.01)

    counter = asyncio.create_task(count_copies())
    fleet[cluster].outage(True)
    requeued = await h.wait_event(job_id, "requeued", timeout=15)
    if self_fence:  # an infrastructure loss, named with the cluster and how long it was silent
        assert (requeued.reason or "").startswith(f"fenced: cluster {cluster} unreachable for ")
    else:
        assert requeued.reason == "cluster-lost"
    await h.wait_event(job_id, "running", count=2, timeout=15)
    assert fleet.history(job_id)[-1].cluster == other
    if self_fence:
        assert fleet.live_copies(job_id) == [(other, 2)]
        # Stopped by the cluster's fence (evicted) or by the agent's self-fence (cancelled).
        assert fleet.history(job_id)[0].end_phase in ("cancelled", "evicted")
    else:
        assert (cluster, 1) in fleet.live_copies(job_id)  # still running behind the partition
    fleet[cluster].outage(False)
    await h.wait_for(lambda: (cluster, 1) not in fleet.live_copies(job_id), 15)
    counter.cancel()
    assert fleet.live_copies(job_id) == [(other, 2)]
    if self_fence:
        assert max(copies) == 1, "two live copies during the partition"
    view = await world.job(job_id)
    assert view["state"] == "running" and view["cluster"] == other and view["attempt"] == 2


async def test_broker_crash_in_the_middle_of_a_recovery(world: World) -> None:
    fleet = await world.start(
        {"a": [flavor("spot", "spot", nodes=1)], "b": [flavor("spot", "spot", nodes=1)]},
        checkpoint_write_s=6.0,  # the emergency checkpoint takes a while: crash during it
    )
    h = world.harness
    job_id = (await h.submit(sim_job("crashy", steps=600, capacity="spot"))).job_id
    cluster, nodes = await _running_on(world, job_id)
    await _wait_step(world, job_id, 1, 40)
    fleet[cluster].spot_notice(nodes[0], lead_s=120)
    await h.wait_event(job_id, "preempting", timeout=10)
    await h.crash_broker()
    await h.start_broker()
    admitted = await h.wait_event(job_id, "admitted", count=2, timeout=30)
    assert admitted.attempt == 2 and admitted.resume_from_step and admitted.resume_from_step >= 40
    await h.wait_event(job_id, "succeeded", timeout=60)
    _assert_resumed_exactly(world, job_id)
    assert [r.attempt for r in fleet.history(job_id)] == [1, 2]
    assert world.max_live_copies[job_id] == 1


def _correlated_removal() -> list[str]:
    """The first instant in the p3 trace where several nodes are reclaimed at once."""
    path = TRACES / "bamboo-p3.csv"
    if not path.exists():
        pytest.skip(f"{path} is not in this copy of the repository (data/traces ships with it)")
    by_time: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        t, op, node = line.strip().split(",")
        if op == "remove":
            by_time.setdefault(int(t), []).append(node)
    return next(nodes for _, nodes in sorted(by_time.items()) if len(nodes) >= 3)


async def test_correlated_loss_from_the_bamboo_trace(world: World) -> None:
    removed = _correlated_removal()
    n = len(removed)
    fleet = await world.start(
        {
            "p3": [flavor("spot", "spot", gpu_type="V100", nodes=n)],
            "spare": [flavor("od", "on-demand", gpu_type="V100", nodes=n, price=3.0)],
        }
    )
    h = world.harness
    ids = [
        (await h.submit(sim_job(f"p3-{i}", steps=500, gpu_types=["V100"]))).job_id for i in range(n)
    ]
    for job_id in ids:
        await _running_on(world, job_id)
    assert all(fleet.history(j)[0].cluster == "p3" for j in ids)  # spot is cheaper
    for job_id in ids:
        await _wait_step(world, job_id, 1, 30)
    # Trace nodes map onto the pool's nodes in order; they are all reclaimed at one instant.
    for node in fleet["p3"].nodes_of("spot")[:n]:
        fleet["p3"].spot_notice(node, lead_s=120)
    for job_id in ids:
        admitted = await h.wait_event(job_id, "admitted", count=2, timeout=20)
        assert admitted.cluster == "spare"
    for job_id in ids:
        await h.wait_event(job_id, "succeeded", timeout=60)
        # A periodic checkpoint that lands after the notice already ends the old attempt; the
        # CheckpointNow the agent finishes before its Cancel arrives may add one more that
        # nobody resumes from. So: resumed from a checkpoint taken after the notice, and never
        # from one the old attempt did not write.
        before, after = fleet.history(job_id)
        assert before.last_checkpoint_step is not None
        assert 30 <= after.started_from_step <= before.last_checkpoint_step
        assert world.max_live_copies[job_id] == 1
