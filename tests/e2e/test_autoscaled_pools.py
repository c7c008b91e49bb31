"""Autoscaled pools end to end over a real nats-server: a spot-only gang submitted while its
pool has no node is accepted, one cluster (the cheaper) is asked to grow, the new nodes are
reported and the gang runs on them; when that pool stocks out, the next one is asked."""

from __future__ import annotations

import msgspec

from agents.config import FakeAutoscale, FakeFlavor, PoolConfig
from agents.fleet import Fleet
from tests.e2e.conftest import World, flavor, sim_job
from tests.world import TIME_SCALE

# The broker's clock is real seconds; the fake clusters' is TIME_SCALE times faster. Windows
# that should not run out are long, so a loaded machine cannot turn a slow node into a stockout.
READY_S = 1.5
LONG_WINDOW_S = 30.0


def pooled(name: str, price: float, **autoscale: object) -> FakeFlavor:
    """A spot flavor scaled to zero whose provider brings nodes up after READY_S."""
    scale = FakeAutoscale(delay_s=READY_S * TIME_SCALE, spread=0.0, **autoscale)  # type: ignore[arg-type]
    return msgspec.structs.replace(flavor(name, price=price, nodes=0), autoscale=scale)


def pool(name: str, window_s: float = LONG_WINDOW_S) -> PoolConfig:
    return PoolConfig(flavor=name, max_nodes=4, gpu_per_node=8, ready_s=READY_S, window_s=window_s)


async def run_gang(world: World, fleet: Fleet) -> tuple[str, str]:
    """Submit a 2 x 8 GPU spot-only gang; wait until it runs. Returns (job, its cluster)."""
    h = world.harness
    reply = await h.submit(sim_job("grown", replicas=2, steps=40, capacity="spot"))
    assert reply.accepted, reply
    await h.wait_event(reply.job_id, "running", timeout=45)
    (attempt,) = fleet.history(reply.job_id)
    return reply.job_id, attempt.cluster


async def test_a_spot_gang_runs_on_nodes_its_pool_adds_and_only_one_cluster_scales(
    world: World,
) -> None:
    fleet = await world.start(
        {"east": [pooled("spot-a", 1.0)], "west": [pooled("spot-b", 1.4)]},
        pools={"east": [pool("spot-a")], "west": [pool("spot-b")]},
    )
    assert fleet["east"].nodes == [] and fleet["west"].nodes == []
    job, cluster = await run_gang(world, fleet)
    assert cluster == "east"
    (attempt,) = fleet.history(job)
    assert sorted({n for _, n in attempt.pods}) == ["east-spot-a-0", "east-spot-a-1"]
    assert fleet["east"].counters["provision_asks"] == 1
    assert fleet["west"].counters["provision_asks"] == 0 and fleet["west"].nodes == []
    await world.harness.wait_event(job, "succeeded", timeout=30)
    assert world.max_live_copies[job] == 1


async def test_a_stockout_moves_the_gang_to_the_next_pool(world: World) -> None:
    fleet = await world.start(
        {
            "east": [pooled("spot-a", 1.0, stockouts=[(0.0, 1e6)])],  # a drought
            "west": [pooled("spot-b", 1.4)],
        },
        pools={"east": [pool("spot-a", window_s=4.0)], "west": [pool("spot-b")]},
    )
    job, cluster = await run_gang(world, fleet)
    assert cluster == "west"
    assert fleet["east"].counters["stockouts"] == 1 and fleet["east"].nodes == []
    assert fleet["west"].counters["provision_asks"] == 1
    assert fleet["east"].counters["provision_asks"] == 1  # east was asked once, first
    await world.harness.wait_event(job, "succeeded", timeout=30)
