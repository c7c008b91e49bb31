"""The submit-reply rendezvous after a copy of a submission never reached the stream (a stream
server down in a NATS cluster): retries of the same job are answered, each on its own reply
subject, never onto the dead reply of the lost copy."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from schemas.codec import decode_submit_reply, encode_json
from tests.broker.conftest import Harness

JOB = {"name": "keep", "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}


@pytest.mark.parametrize("identity", ["job_id", "Nats-Msg-Id"])
async def test_retries_after_a_lost_stream_copy_are_all_answered(
    harness: Harness, identity: str
) -> None:
    broker = await harness.start_broker()
    job = {**JOB, "job_id": "keep-1"} if identity == "job_id" else JOB
    data = encode_json(job)
    headers = {"Nats-Msg-Id": "retry-key-7f3a9c"} if identity == "Nats-Msg-Id" else None
    subject = harness.subjects.submit("default")
    # The broker's plain subscription heard this copy; the stream never stored it, so no
    # outcome will ever come for it. Its requester gave up long ago.
    lost = Msg(
        harness.nc, subject=subject, reply=harness.nc.new_inbox(), data=data, headers=headers
    )
    await broker.rendezvous.on_request(lost)
    job_ids = set()
    for _ in range(8):
        msg = await harness.nc.request(subject, data, timeout=3, headers=headers)
        reply = decode_submit_reply(msg.data)
        assert reply.accepted, reply.error
        job_ids.add(reply.job_id)
    assert len(job_ids) == 1  # every retry is the same job
    if identity == "job_id":
        assert job_ids == {"keep-1"}
    assert not broker.rendezvous.waiting  # nobody is left waiting, the lost copy included


async def test_equal_bodies_without_identity_are_different_jobs_each_answered(
    harness: Harness,
) -> None:
    """Without `job_id` or `Nats-Msg-Id`, equal bytes are two jobs: each requester gets its own."""
    await harness.start_broker()
    data = encode_json(JOB)
    subject = harness.subjects.submit("default")
    first = decode_submit_reply((await harness.nc.request(subject, data, timeout=3)).data)
    second = decode_submit_reply((await harness.nc.request(subject, data, timeout=3)).data)
    assert first.accepted and second.accepted
    assert first.job_id != second.job_id
