"""Per-queue intake: a flood into one queue does not hold another queue's submissions."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from broker.intake import consumer_name
from tests.broker.conftest import Harness
from tests.broker.jobs import job
from tests.support import wait_for

FLOOD = 20_000


def _ack_fields(subject: str) -> tuple[str, int]:
    """(consumer, stream sequence) from a JetStream ack subject (both token layouts)."""
    tokens = subject.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return tokens[3], int(tokens[5])
    return tokens[5], int(tokens[7])  # with domain and account hash


async def test_a_flood_in_one_queue_does_not_hold_another_queues_submission(
    harness: Harness,
) -> None:
    """20,000 submissions wait in `default` and one in `research` arrived after all of them.
    The broker must take the `research` one before the `default` backlog drains: the order of
    the broker's acks on the wire shows it, with no clock involved."""
    await harness.start_broker()
    await harness.stop_broker()
    nc = harness.nc
    stream = harness.subjects.submit_stream
    acks: list[tuple[str, int]] = []
    done = asyncio.Event()
    last_seq = 0

    async def on_ack(msg: Msg) -> None:
        acks.append(_ack_fields(msg.subject))
        if acks[-1][1] == last_seq:
            done.set()

    await nc.subscribe(f"$JS.ACK.{stream}.>", cb=on_ack)
    await nc.subscribe(f"$JS.ACK.*.*.{stream}.>", cb=on_ack)
    flood = b"{not json"  # refused on arrival: the flood costs no storage
    for _ in range(FLOOD):
        await nc.publish(harness.subjects.submit("default"), flood)
    await nc.publish(harness.subjects.submit("research"), b"{also not json")
    await nc.flush()
    js = nc.jetstream()
    # Plain publishes are stored asynchronously: wait until the stream holds all of them.

    async def stored() -> bool:
        return (await js.stream_info(stream)).state.messages >= FLOOD + 1

    await wait_for(stored, 30, what="the flood stored", interval=0.05)
    info = await js.stream_info(stream)
    assert info.state.messages == FLOOD + 1
    last_seq = info.state.last_seq
    await harness.start_broker()
    await asyncio.wait_for(done.wait(), 60)
    ahead = [a for a in acks[: acks.index((consumer_name("research"), last_seq))]]
    # At most the batches already in flight when it arrived, far from the whole backlog.
    assert len(ahead) < FLOOD // 4, len(ahead)
    assert all(consumer == consumer_name("default") for consumer, _ in ahead)


async def test_submission_to_an_unknown_queue_is_refused_and_not_stored(harness: Harness) -> None:
    await harness.start_broker()
    reply = await harness.submit(job("lost", replicas=1, gpu=1), queue="nosuchqueue")
    assert not reply.accepted
    assert "unknown queue 'nosuchqueue'" in (reply.error or "")
    assert "default, research" in (reply.error or "")
    info = await harness.nc.jetstream().stream_info(harness.subjects.submit_stream)
    assert info.state.messages == 0 and info.state.last_seq == 0


async def test_a_misspelt_queue_is_refused_with_the_closest_name(harness: Harness) -> None:
    await harness.start_broker()
    reply = await harness.submit(job("typo", replicas=1, gpu=1), queue="reserch")
    assert not reply.accepted
    assert "did you mean 'research'?" in (reply.error or ""), reply.error
