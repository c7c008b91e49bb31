"""A batch's reply shared out as one answer per Dispatch once its Dispatches went on alone:
each share gets its own ack, the whole batch's refusal, or why there was none, and the batch's
request is forgotten once every share is settled, answered or not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nats.errors import NoRespondersError

from broker.dispatchbatches import SharedReply, read_ack
from schemas.agent import CommandAck, DispatchAcks
from schemas.codec import encode_msgpack
from shell.natsio import Asked


def batch_request() -> tuple[Asked, list[Asked]]:
    """A batch's request, and the list its forgetting is recorded in."""
    return Asked("7", asyncio.get_running_loop().create_future(), 1.0), []


async def test_each_share_gets_its_own_ack_and_the_batch_is_forgotten_once() -> None:
    asked, forgotten = batch_request()
    shared = SharedReply(asked, "east", 3, forgotten.append)
    acks = [CommandAck(ok=True), CommandAck(ok=False, error="older"), CommandAck(ok=True)]
    asked.reply.set_result(SimpleNamespace(data=encode_msgpack(DispatchAcks(acks=acks))))
    await asyncio.sleep(0)
    assert [read_ack("east", part.reply) for part in shared.parts] == acks
    assert [part.sent for part in shared.parts] == [1.0] * 3  # round trips from the batch
    await asyncio.sleep(0)
    assert forgotten == [asked]


async def test_a_refusal_of_the_whole_batch_is_each_shares_answer() -> None:
    asked, _ = batch_request()
    shared = SharedReply(asked, "east", 2, lambda _: None)
    stale = CommandAck(ok=False, stale_epoch=True, epoch=9, error="stale epoch 3")
    asked.reply.set_result(SimpleNamespace(data=encode_msgpack(stale)))
    await asyncio.sleep(0)
    assert [read_ack("east", part.reply) for part in shared.parts] == [stale, stale]


async def test_no_responders_and_a_short_answer_are_each_shares_reason() -> None:
    asked, _ = batch_request()
    shared = SharedReply(asked, "east", 2, lambda _: None)
    asked.reply.set_exception(NoRespondersError())
    await asyncio.sleep(0)
    assert [read_ack("east", p.reply) for p in shared.parts] == [
        "no agent is listening for cluster 'east'"
    ] * 2
    asked, _ = batch_request()
    shared = SharedReply(asked, "east", 2, lambda _: None)
    one = DispatchAcks(acks=[CommandAck(ok=True)])
    asked.reply.set_result(SimpleNamespace(data=encode_msgpack(one)))
    await asyncio.sleep(0)
    assert all("1 acks for 2 dispatches" in str(read_ack("east", p.reply)) for p in shared.parts)


async def test_a_batch_never_answered_is_forgotten_once_its_shares_are() -> None:
    """The one-by-one path forgets each share when it is done with it (an ack of a later copy,
    its retries spent); the batch's own request must not outlive them."""
    asked, forgotten = batch_request()
    shared = SharedReply(asked, "east", 3, forgotten.append)
    shared.parts[0].reply.set_result(CommandAck(ok=True))  # answered by a later copy
    shared.parts[1].reply.cancel()
    await asyncio.sleep(0)
    assert forgotten == []
    shared.parts[2].reply.cancel()
    await asyncio.sleep(0)
    assert forgotten == [asked]


async def test_a_batch_request_cancelled_cancels_every_share() -> None:
    asked, _ = batch_request()
    shared = SharedReply(asked, "east", 2, lambda _: None)
    asked.reply.cancel()  # the leadership ended: nobody waits for it any more
    await asyncio.sleep(0)
    assert all(part.reply.cancelled() for part in shared.parts)
