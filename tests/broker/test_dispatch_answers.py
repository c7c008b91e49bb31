"""What the broker makes of a Dispatch's answers other than an ack in time: nobody listening
on the cluster's command subject, and an answer that is not an ack. Each copy is counted,
the attempt fails with the reason, and the job is requeued; nothing else changes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from nats.aio.msg import Msg

from broker.lease import KEY, LeaseHolder
from schemas.agent import Dispatch
from schemas.codec import decode_command
from tests.broker.conftest import Harness, broker_config
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


async def test_a_leader_deposed_while_a_copy_waits_for_its_ack_sends_no_further_copy(
    harness: Harness,
) -> None:
    """Another broker took the lease while the first copy of a Dispatch waited for its ack:
    the deposed leader neither retries it nor counts it failed. A copy sent at its epoch
    after it stepped down would be a second order for the same attempt from a broker that
    no longer decides (the new leader dispatches from the records, at a higher epoch)."""
    ack_wait = 3.0
    broker = await harness.start_broker(broker_config(harness.prefix, dispatch_ack_s=ack_wait))
    agent = await harness.agent("c1")
    await agent.stop_answering()
    copies: list[tuple[float, Dispatch]] = []
    loop = asyncio.get_running_loop()

    async def silent(msg: Msg) -> None:  # hears every copy, answers none
        cmd: Any = decode_command(msg.data)
        if isinstance(cmd, Dispatch):
            copies.append((loop.time(), cmd))

    sub = await harness.nc.subscribe(harness.subjects.agent_cmd("c1"), cb=silent)
    try:
        reply = await harness.submit(job("orphaned", 1, 8))
        assert reply.accepted
        await harness.wait_for(lambda: bool(copies))
        sent, first = copies[0]
        kv = await harness.nc.jetstream().key_value(broker.lease.bucket)
        await kv.put(KEY, msgspec.json.encode(LeaseHolder(holder="thief", acquired_at=time.time())))
        await harness.wait_for(lambda: not broker.leading.is_set())
        assert loop.time() < sent + ack_wait, "stepped down only after the ack wait"
        failed = broker.stats["dispatch_failed"]
        # Past the ack wait, with room for a retry to reach the wire: nothing more came.
        await asyncio.sleep(sent + ack_wait + 1.0 - loop.time())
        again = [c for _, c in copies[1:] if c.epoch == first.epoch]
        assert again == [], "the deposed leader sent another copy at its epoch"
        assert broker.stats["dispatch_failed"] == failed
    finally:
        await sub.unsubscribe()
