"""An agent carries out a DispatchBatch as its Dispatches one by one, and answers them all in
one message (wire 1.3)."""

from __future__ import annotations

from schemas.agent import CommandAck, DispatchAcks, DispatchBatch, Resync
from schemas.job import Simulation
from tests.agents.conftest import MakeAgent
from tests.agents.helpers import dispatch

SLOW = Simulation(total_steps=100_000, steps_per_second=20.0, checkpoint_every=10)


def on_demand(epoch: int, jobs: dict[str, tuple[str, int]]) -> DispatchBatch:
    """A batch of epoch `epoch`: each job on its node, with the epoch its Dispatch carries."""
    return DispatchBatch(
        epoch=epoch,
        dispatches=[
            dispatch(job_id, [node], epoch=e, flavor="od-a100", sim=SLOW)
            for job_id, (node, e) in jobs.items()
        ],
    )


async def test_each_dispatch_of_a_batch_is_carried_out_and_answered_in_order(
    make_agent: MakeAgent,
) -> None:
    a = await make_agent()
    n0, n1, n2 = a.cluster.nodes_of("spot-a100")[:3]
    assert (await a.wire.send(dispatch("job-old", [n0], attempt=2, sim=SLOW))).ok
    batch = DispatchBatch(
        epoch=1,
        dispatches=[
            dispatch("job-b1", [n1], sim=SLOW),
            dispatch("job-old", [n0], attempt=1, sim=SLOW),  # older than the one running
            dispatch("job-b2", [n2], sim=SLOW),
            dispatch("job-b1", [n1], sim=SLOW),  # again: acknowledged, not run twice
        ],
    )
    answer = await a.wire.send_batch(batch)
    assert isinstance(answer, DispatchAcks)
    assert [ack.ok for ack in answer.acks] == [True, False, True, True]
    assert "older" in answer.acks[1].error
    await a.wire.wait_status("job-b1", 1, "running")
    await a.wire.wait_status("job-b2", 1, "running")
    assert len(a.cluster.history["job-b1"]) == 1
    assert sorted(a.cluster.live_workloads()) == [("job-b1", 1), ("job-b2", 1), ("job-old", 2)]


async def test_a_stale_batch_is_refused_whole_and_a_stale_dispatch_in_one_alone(
    make_agent: MakeAgent,
) -> None:
    a = await make_agent()
    n0, n1 = a.cluster.nodes_of("od-a100")[:2]
    assert (await a.wire.send(Resync(epoch=5))).ok
    answer = await a.wire.send_batch(on_demand(4, {"job-s1": (n0, 4), "job-s2": (n1, 4)}))
    assert isinstance(answer, CommandAck)
    assert answer.stale_epoch and answer.epoch == 5 and not answer.ok
    answer = await a.wire.send_batch(on_demand(5, {"job-s1": (n0, 5), "job-s2": (n1, 4)}))
    assert isinstance(answer, DispatchAcks)
    assert answer.acks[0].ok
    assert answer.acks[1].stale_epoch and not answer.acks[1].ok
    assert "job-s2" not in a.cluster.history
    assert a.cluster.live_workloads() == [("job-s1", 1)]
