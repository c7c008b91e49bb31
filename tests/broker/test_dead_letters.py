"""Dead letters are for submissions that failed on their own: deliveries that went unacked only
because the job bucket refused writes are not counted against the message."""

from __future__ import annotations

import pytest

from broker import intake
from schemas.codec import encode_json
from tests.broker.conftest import Harness
from tests.support import wait_for

JOB = {"job_id": "kept-1", "name": "kept", "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}


async def bucket_takes(harness: Harness, writes: bool) -> None:
    """The job bucket refuses every write (a record is over its size limit) or takes them; it
    stays readable, as a bucket whose writes fail while its data is there."""
    assert harness.broker is not None and harness.broker.store is not None
    js = harness.nc.jetstream()
    info = await js.stream_info(harness.broker.store.stream)
    info.config.max_msg_size = -1 if writes else 1
    await js.update_stream(info.config)


async def test_no_dead_letter_while_the_bucket_refuses_writes(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)  # redeliveries come fast
    first = await harness.start_broker()
    await bucket_takes(harness, writes=False)
    await harness.nc.publish(harness.subjects.submit("default"), encode_json(JOB))
    await wait_for(lambda: "kept-1" in (first.machine.jobs if first.machine else {}), 10)
    # The broker dies while the record waits for the store: that delivery counts.
    await harness.crash_broker()
    second = await harness.start_broker()
    await wait_for(lambda: "kept-1" in (second.machine.jobs if second.machine else {}), 10)
    # Several ack deadlines pass while the record waits for the store.
    await wait_for(
        lambda: second.stats["dead_lettered"] > 0 or second.stats["held_for_storage"] >= 9,
        30,
        what="three ack deadlines with the record held",
    )
    assert second.stats["dead_lettered"] == 0
    assert second.refused["dead_letter"] == 0
    # The bucket takes writes again: the held submission persists, new ones go through.
    await bucket_takes(harness, writes=True)
    reply = await harness.submit({**JOB, "job_id": "after-1"})
    assert reply.accepted and not reply.duplicate, reply
    again = await harness.submit(JOB)  # a retry of the held one: it exists
    assert again.accepted and again.job_id == "kept-1"
    records = {r.job_id for r in await second.store.load_all()} if second.store else set()
    assert {"kept-1", "after-1"} <= records
    assert second.stats["dead_lettered"] == 0
