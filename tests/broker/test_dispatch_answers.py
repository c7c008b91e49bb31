"""What the broker makes of a Dispatch's answers other than an ack in time: nobody listening
on the cluster's command subject, and an answer that is not an ack. Each copy is counted,
the attempt fails with the reason, and the job is requeued; nothing else changes."""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from schemas.agent import Dispatch
from schemas.codec import decode_command
from tests.broker.conftest import Harness
from tests.broker.jobs import job


def _failed_with(harness: Harness, job_id: str, words: str) -> bool:
    return any(
        e.kind == "requeued" and e.reason is not None and words in e.reason
        for e in harness.events[job_id]
    )


async def test_a_cluster_nobody_listens_for_fails_the_dispatch_after_every_copy(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    agent = await harness.agent("c1")
    await agent.stop_answering()  # heartbeats go on: the cluster still looks healthy
    reply = await harness.submit(job("unheard", 1, 8))
    assert reply.accepted
    words = "no agent is listening for cluster 'c1'"
    await harness.wait_for(lambda: _failed_with(harness, reply.job_id, words))
    # Both copies went out (dispatch_retries=1) before the attempt counted as failed.
    assert broker.stats["ack_retries"] >= 1
    assert broker.stats["dispatch_failed"] >= 1
    assert broker.stats["dispatch_acked"] == 0


async def test_an_answer_that_is_not_an_ack_fails_the_dispatch_and_changes_nothing_else(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    agent = await harness.agent("c1")
    await agent.stop_answering()
    copies: list[Dispatch] = []

    async def garbage(msg: Msg) -> None:
        cmd: Any = decode_command(msg.data)
        if isinstance(cmd, Dispatch):
            copies.append(cmd)
        await msg.respond(b"\xc1 not an ack")

    sub = await harness.nc.subscribe(harness.subjects.agent_cmd("c1"), cb=garbage)
    try:
        reply = await harness.submit(job("garbled", 1, 8))
        assert reply.accepted
        await harness.wait_for(lambda: _failed_with(harness, reply.job_id, "bad ack from"))
        first = [c for c in copies if c.attempt == 1]
        assert len(first) == 2  # the first copy and its one retry, each answered with garbage
        assert broker.stats["dispatch_acked"] == 0
        assert broker.machine is not None and broker.leading.is_set()
        record = broker.machine.jobs[reply.job_id]
        assert record.state in ("queued", "admitted")  # requeued, maybe admitted again
    finally:
        await sub.unsubscribe()
