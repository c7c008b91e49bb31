"""Dead letters are for submissions that failed on their own: deliveries that went unacked only
because the job bucket refused writes are not counted against the message, and a message that
kills the broker twice while the store takes writes still goes to the dead-letter subject."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client import generate_latest

from broker import intake
from broker.service import Broker
from schemas.codec import encode_json
from tests.broker.conftest import Harness
from tests.broker.wire import next_item
from tests.support import wait_for

JOB = {"job_id": "kept-1", "name": "kept", "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}


async def bucket_takes(harness: Harness, writes: bool) -> None:
    """The job bucket refuses every write (a record is over its size limit) or takes them; it
    stays readable, as a bucket whose writes fail while its data is there."""
    js = harness.nc.jetstream()
    info = await js.stream_info(f"KV_{harness.subjects.jobs_bucket}")
    info.config.max_msg_size = -1 if writes else 1
    await js.update_stream(info.config)


def held(broker: Broker, job_id: str) -> bool:
    return job_id in (broker.machine.jobs if broker.machine else {})


async def test_no_dead_letter_after_two_broker_kills_while_the_bucket_refuses_writes(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)  # redeliveries come fast
    first = await harness.start_broker()
    await bucket_takes(harness, writes=False)
    await harness.nc.publish(harness.subjects.submit("default"), encode_json(JOB))
    # The first delivery is processed; its record waits for the store, the message's ack
    # deadline kept alive meanwhile (no redelivery in three deadlines); then the broker dies.
    await wait_for(lambda: held(first, "kept-1"), 10, what="the first delivery processed")
    await wait_for(
        lambda: first.stats["held_for_storage"] >= 9, 30, what="three ack deadlines held"
    )
    assert first.stats["put_back_for_storage"] == 0
    await harness.crash_broker()
    # The next leader's redeliveries find the store away: put back, and it dies too.
    second = await harness.start_broker()
    await wait_for(
        lambda: second.stats["put_back_for_storage"] >= 1 or held(second, "kept-1"),
        20,
        what="a redelivery put back",
    )
    await harness.crash_broker()
    third = await harness.start_broker()
    await wait_for(
        lambda: third.stats["dead_lettered"] > 0 or third.stats["put_back_for_storage"] >= 2,
        20,
        what="redeliveries put back by the third leader",
    )
    assert third.stats["dead_lettered"] == 0
    assert not held(third, "kept-1")  # never processed while the store is away
    metrics = generate_latest(third.metrics.registry).decode()
    (put_back,) = [
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("muster_submissions_put_back_total ")
    ]
    assert put_back >= 2
    # The bucket takes writes again: the submission goes through, once.
    await bucket_takes(harness, writes=True)
    await wait_for(lambda: held(third, "kept-1"), 20, what="the submission processed")
    store = third.store
    assert store is not None

    async def persisted() -> bool:
        return "kept-1" in {r.job_id for r in await store.load_all()}

    await wait_for(persisted, 20, what="the record in the bucket")
    again = await harness.submit(JOB)  # a retry: it exists
    assert again.accepted and again.job_id == "kept-1", again
    assert third.stats["dead_lettered"] == 0
    assert third.refused["dead_letter"] == 0

    async def drained() -> bool:  # acked, and its attempt marker cleared
        js = harness.nc.jetstream()
        stream = await js.stream_info(harness.subjects.submit_stream)
        if stream.state.messages:
            return False
        marker = f"$KV.{harness.subjects.jobs_bucket}._attempts.>"
        try:
            last = await js.get_last_msg(f"KV_{harness.subjects.jobs_bucket}", marker)
        except Exception:
            return True
        return bool(last.headers and last.headers.get("KV-Operation") == "DEL")

    await wait_for(drained, 10, what="the submission acked and its marker cleared")


async def test_submission_that_killed_the_broker_twice_is_dead_lettered(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message the broker dies on (here: processing it never returns, and the broker is
    killed) twice while the store takes writes: the third delivery is not processed but moved
    to the dead-letter subject with its reason, terminated, and the broker keeps serving."""
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)
    reached: list[int] = []
    guarded = Broker._submit_guarded

    async def dies_on_poison(self: Broker, machine: Any, delivery: Any, *args: Any) -> Any:
        if json.loads(delivery.msg.data).get("name") == "poisoned":
            reached.append(delivery.msg.metadata.num_delivered)
            await asyncio.Event().wait()  # the broker is stuck on it until killed
        return await guarded(self, machine, delivery, *args)

    monkeypatch.setattr(Broker, "_submit_guarded", dies_on_poison)
    dead: asyncio.Queue[Any] = asyncio.Queue()

    async def on_dead(msg: Any) -> None:
        dead.put_nowait(msg)

    await harness.nc.subscribe(harness.subjects.dead_letter("default"), cb=on_dead)
    await harness.start_broker()
    poisoned = {"job_id": "poisoned-1", "name": "poisoned", "gang": JOB["gang"]}
    await harness.nc.publish(harness.subjects.submit("default"), encode_json(poisoned))
    for kills in (1, 2):
        await wait_for(lambda k=kills: len(reached) >= k, 20, what=f"processing attempt {kills}")
        await harness.crash_broker()
        broker = await harness.start_broker()
    msg = await next_item(dead, 20)
    assert json.loads(msg.data)["name"] == "poisoned"
    assert "failed processing 2 times" in msg.headers["Muster-Reason"]
    assert len(reached) == 2  # not processed a third time
    await wait_for(lambda: broker.stats["dead_lettered"] == 1, 10)
    assert not held(broker, "poisoned-1")
    js = harness.nc.jetstream()

    async def removed() -> bool:  # its termination reaches the stream after the count
        return (await js.stream_info(harness.subjects.submit_stream)).state.messages == 0

    await wait_for(removed, 10, what="the dead-lettered submission gone from the stream")
    reply = await harness.submit({**JOB, "job_id": "fine-1"})
    assert reply.accepted
