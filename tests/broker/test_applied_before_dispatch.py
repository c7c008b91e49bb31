"""An agent hears the `Applied` of a batch before any Dispatch the broker placed on what that
batch told it. Its gate refuses a Dispatch that would start an attempt once the broker has
not acknowledged the cluster for the fence (`agents/gate.py`): after an outage that long, a
Dispatch that overtook the `Applied` of the batch it was placed on would be refused as read
late, its job sent elsewhere and the pool's breaker opened."""

from __future__ import annotations

from schemas.agent import Applied, CheckpointReport, Dispatch, DispatchBatch
from tests.broker.conftest import Harness
from tests.broker.jobs import job


def _dispatched(cmd: object, job_id: str) -> bool:
    if isinstance(cmd, DispatchBatch):
        return any(d.job_id == job_id for d in cmd.dispatches)
    return isinstance(cmd, Dispatch) and cmd.job_id == job_id


async def test_the_applied_of_a_batch_leaves_before_the_dispatches_placed_on_it(
    harness: Harness,
) -> None:
    h = harness
    await h.start_broker()
    agent = await h.agent("c1", count=1)  # one node of 8 GPUs
    for round_ in range(5):
        first = (await h.submit(job(f"a{round_}", replicas=1, gpu=8))).job_id
        await h.wait_event(first, "running")
        waiting = (await h.submit(job(f"b{round_}", replicas=1, gpu=8))).job_id
        await h.wait_event(waiting, "queued")
        # The broker keeps one Applied in flight per cluster: with heartbeats paused (for far
        # less than `unreachable_after_s`) and a checkpoint (kept until acknowledged) heard,
        # none is in flight when the ending comes, so its own is the next the agent hears.
        agent.silent = True
        await agent.send(CheckpointReport(job_id=first, attempt=1, step=1, uri="s3://c/1"))
        await h.wait_for(
            lambda: any(isinstance(c, Applied) and c.seq == agent.seq for c in agent.commands)
        )
        # The ending frees the node; the broker places the waiting job on it.
        await agent.finish(first, 1)
        ended_in = agent.seq
        await h.wait_for(lambda j=waiting: any(_dispatched(c, j) for c in agent.commands))
        agent.silent = False
        commands = list(agent.commands)
        at = next(i for i, c in enumerate(commands) if _dispatched(c, waiting))
        heard = [c for c in commands[:at] if isinstance(c, Applied) and c.seq >= ended_in]
        assert heard, (
            f"round {round_}: the Dispatch of {waiting} reached the agent before the Applied of "
            f"batch {ended_in}, which freed its node"
        )
        await agent.finish(waiting, 1)
        await h.wait_event(waiting, "succeeded")
