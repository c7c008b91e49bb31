"""The seed's elastic PyTorchJob (minReplicas 2, maxReplicas 8), submitted unchanged over NATS
to a fake fleet: admitted at what fits, shrunk in place by a spot notice (the same attempt goes
on) and grown back when a node returns; and a growth the workload refuses, given back."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from agents.backend import CannotResize
from schemas.agent import Dispatch
from tests.e2e.conftest import World, flavor

SEED = Path(__file__).parents[1] / "cli" / "fixtures" / "pytorchjob-elastic-spot.yaml"
# One GPU a node, as the seed's workers ask: one worker a node, so a notice takes one worker.
SPOT = msgspec.structs.replace(flavor("spot", "spot", nodes=4), gpu_per_node=1)


async def test_the_seed_elastic_job_shrinks_in_place_and_grows_back(world: World) -> None:
    # 0.5 simulated seconds a second: the default simulated run (100 steps at 10/s) takes 20 s
    fleet = await world.start({"east": [SPOT]}, time_scale=0.5)
    h = world.harness
    reply = await h.submit(yaml.safe_load(SEED.read_text(encoding="utf-8")))
    assert reply.accepted, reply
    job = reply.job_id
    admitted = await h.wait_event(job, "admitted", timeout=15)
    assert admitted.reason == (
        "admitted 4 of 8 worker replicas (min 2): east/spot has room for 4 on 4 free A100 nodes now"
    )
    await h.wait_event(job, "running", timeout=15)
    (first,) = fleet.history(job)
    assert len(first.pods) == 4

    reclaimed = first.nodes[0]
    fleet["east"].spot_notice(reclaimed, lead_s=2)  # reclaimed long before the run ends
    shrunk = await h.wait_event(job, "resized", timeout=15)
    assert shrunk.reason == (
        f"spot-notice on {reclaimed}, shrunk to 38% of full speed (no whole-gang placement "
        "elsewhere): worker 4 -> 3"
    )
    assert shrunk.attempt == 1
    why = await h.api("why", {"job_id": job})
    size = "worker runs 3 of 8 replicas (min 2; grows back when its pool has room)"
    assert size in [r["message"] for r in why["result"]["reasons"]]
    assert (await world.job(job))["size"] == size  # what `muster status` and the dashboard show

    fleet["east"].add_node("spot")  # capacity returns to the same pool
    grown = await h.wait_event(job, "resized", count=2, timeout=15)
    assert grown.reason == "capacity returned: worker 3 -> 4" and grown.attempt == 1
    done = await h.wait_event(job, "succeeded", timeout=60)
    assert done.attempt == 1
    assert h.kinds(job).count("admitted") == 1  # never moved, never restarted
    (only,) = fleet.history(job)  # the one attempt, on the nodes it ran on last
    assert reclaimed not in only.nodes and len(only.pods) == 4
    assert world.max_live_copies[job] == 1


async def test_a_growth_the_workload_refuses_is_given_back_and_the_job_runs_on(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster cannot grow this workload in place (as a JobSet, or a Job whose immutable
    template pins other nodes): the broker gives the growth back over NATS, the attempt goes
    on at its size to success, and it is not offered growth again."""
    fleet = await world.start({"east": [SPOT]}, time_scale=0.5)
    east = fleet["east"]
    shrink_or_same = east.resize

    async def refuse_growth(cmd: Dispatch) -> None:
        live = east.history.get(cmd.job_id, [])[-1]
        if sum(len(a.nodes) for a in cmd.assignment) > len(live.nodes):
            raise CannotResize(f"PyTorchJob {cmd.job_id}-a1: its pods cannot use new nodes")
        await shrink_or_same(cmd)

    monkeypatch.setattr(east, "resize", refuse_growth)
    h = world.harness
    reply = await h.submit(yaml.safe_load(SEED.read_text(encoding="utf-8")))
    assert reply.accepted, reply
    job = reply.job_id
    await h.wait_event(job, "running", timeout=15)
    east.add_node("spot")
    east.add_node("spot")
    grew = await h.wait_event(job, "resized", timeout=15)
    assert grew.reason == "capacity returned: worker 4 -> 6"
    given = await h.wait_event(job, "resized", count=2, timeout=15)
    stays = f"cluster east cannot grow PyTorchJob {job}-a1 in place: its pods cannot use new nodes"
    assert given.reason == f"growth given back, {stays}: worker 6 -> 4"
    why = await h.api("why", {"job_id": job})
    reasons = {r["code"]: r["message"] for r in why["result"]["reasons"]}
    assert reasons["elastic"] == (
        "worker runs 4 of 8 replicas (min 2; stays: its cluster cannot grow it in place)"
    )
    assert reasons["grow-refused"] == stays
    east.add_node("spot")  # more room: not offered to this attempt again
    done = await h.wait_event(job, "succeeded", timeout=60)
    assert done.attempt == 1 and h.kinds(job).count("resized") == 2
    assert h.kinds(job).count("admitted") == 1  # never moved
    (only,) = fleet.history(job)
    assert len(only.pods) == 4
    assert world.max_live_copies[job] == 1
