"""A submission names its reply subject in the `Muster-Reply-To` header, which the submit
stream keeps: the broker answers the stored copy there, once, even when nobody heard the plain
copy (no broker led when it was published), and never on a subject the plain path would refuse
(broker/rendezvous.py)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from prometheus_client import generate_latest

from broker import intake
from broker.rendezvous import RendezvousKey
from schemas.api import SubmitReply
from schemas.codec import decode_submit_reply, encode_json
from schemas.subjects import REPLY_HEADER
from shell.natsio import flush, requester_of
from tests.broker.conftest import Harness
from tests.broker.jobs import processed_with_headers_refused
from tests.support import wait_for


def spec(job_id: str) -> bytes:
    return encode_json(
        {"name": "hdr", "job_id": job_id, "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}
    )


class Inbox:
    """Every message on one reply subject, counted."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.subject = f"_INBOX.{uuid.uuid4().hex}"
        self.got: list[Msg] = []

    async def start(self) -> Inbox:
        async def heard(msg: Msg) -> None:
            self.got.append(msg)

        await self.nc.subscribe(self.subject, cb=heard)
        await flush(self.nc)
        return self

    def replies(self) -> list[SubmitReply]:
        return [decode_submit_reply(m.data) for m in self.got]


async def publish(harness: Harness, data: bytes, inbox: Inbox, header: str | None) -> None:
    """A submission with a plain reply subject, and the header if given, as a client sends it."""
    headers = {REPLY_HEADER: header} if header is not None else None
    await harness.nc.publish(
        harness.subjects.submit("default"), data, reply=inbox.subject, headers=headers
    )
    await flush(harness.nc)


async def settled(harness: Harness) -> None:
    """A later submission answered: the broker's answers to earlier ones went out before it."""
    reply = await harness.submit(spec(f"sentinel-{uuid.uuid4().hex[:8]}"))
    assert reply.accepted, reply.error
    await flush(harness.nc)


async def test_a_submission_stored_while_no_broker_leads_is_answered_once_one_leads(
    harness: Harness,
) -> None:
    await harness.start_broker()  # makes the submit stream
    await harness.crash_broker()  # the leader is dead; nobody hears plain copies now
    bare = await Inbox(harness.nc).start()  # a client without the header: the control
    await publish(harness, spec("orphan-bare"), bare, header=None)
    requests = requester_of(harness.nc)  # as `submit_request` sends it
    subject = harness.subjects.submit("default")
    asked = await requests.ask(subject, spec("orphan-1"), reply_header=REPLY_HEADER)
    await flush(harness.nc)  # published, and stored, before any broker leads
    broker = await harness.start_broker()
    try:
        reply = decode_submit_reply((await asyncio.wait_for(asked.reply, 30)).data)
    finally:
        requests.forget(asked)
    assert reply.accepted and reply.job_id == "orphan-1" and not reply.duplicate, reply
    machine = broker.machine
    assert machine is not None
    await wait_for(lambda: "orphan-bare" in machine.jobs, 10, what="the bare copy processed")
    await settled(harness)
    # Without the header the stored copy has nobody to answer: the fault this header closes.
    assert bare.got == []


async def test_a_plain_copy_heard_after_its_stored_copy_was_taken_is_no_duplicate(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded broker may hear a submission's plain copy only after it took the stored copy
    from the stream, when the job is known: that copy is not a retry, and the submitter gets
    one answer, not a duplicate of its own job."""
    broker = await harness.start_broker()
    inbox = await Inbox(harness.nc).start()
    headers = {REPLY_HEADER: inbox.subject, "Nats-Msg-Id": "late-plain-1"}
    subject = harness.subjects.submit("default")
    rendezvous = broker.rendezvous
    on_result = rendezvous.on_result
    heard: list[Msg] = []

    async def plain_copy_heard_late(
        subj: str,
        data: bytes,
        hdrs: dict[str, str] | None,
        payload: bytes,
        key: RendezvousKey | None = None,
    ) -> None:
        if hdrs and hdrs.get("Nats-Msg-Id") == "late-plain-1" and not heard:
            # The stored copy is taken and its record persisted, not yet answered.
            heard.append(
                Msg(harness.nc, subject=subj, reply=inbox.subject, data=data, headers=hdrs)
            )
            await rendezvous.on_request(heard[0])
        await on_result(subj, data, hdrs, payload, key)

    monkeypatch.setattr(rendezvous, "on_result", plain_copy_heard_late)
    await harness.nc.publish(subject, spec("late-1"), headers=headers)
    await wait_for(lambda: inbox.got, 10, what="the answer")
    await settled(harness)
    assert heard
    assert [(r.accepted, r.job_id, r.duplicate) for r in inbox.replies()] == [
        (True, "late-1", False)
    ]


@pytest.mark.parametrize("msg_id", [None, "retry-5be1"])
async def test_a_submission_with_header_and_plain_copy_is_answered_once(
    harness: Harness, msg_id: str | None
) -> None:
    broker = await harness.start_broker()
    inbox = await Inbox(harness.nc).start()
    headers = {REPLY_HEADER: inbox.subject}
    if msg_id is not None:
        headers["Nats-Msg-Id"] = msg_id
    subject = harness.subjects.submit("default")
    await harness.nc.publish(subject, spec("once-1"), reply=inbox.subject, headers=headers)
    await wait_for(lambda: inbox.got, 10, what="the answer")
    retries = []
    if msg_id is not None:
        # A retry under the same id, which the stream drops as a duplicate (only its plain
        # copy can be answered), and one under another id, which the stream stores too (its
        # plain copy answers at once, as the job is known; its stored copy then stays silent).
        for retry_id in (msg_id, f"{msg_id}-again"):
            retry = await Inbox(harness.nc).start()
            again = {**headers, REPLY_HEADER: retry.subject, "Nats-Msg-Id": retry_id}
            await harness.nc.publish(subject, spec("once-1"), reply=retry.subject, headers=again)
            retries.append(retry)
        await wait_for(
            lambda: broker.stats["submitted"] >= 2, 10, what="the stored retry processed"
        )
    await settled(harness)
    assert [(r.accepted, r.job_id, r.duplicate) for r in inbox.replies()] == [
        (True, "once-1", False)
    ]
    for retry in retries:
        assert [(r.accepted, r.job_id, r.duplicate) for r in retry.replies()] == [
            (True, "once-1", True)
        ]
    # The plain copy was dropped at once: nothing waits to pair with an outcome.
    assert not broker.rendezvous.waiting and not broker.rendezvous.done


async def test_a_submission_redelivered_after_a_crash_is_answered_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first leader processes the submission but dies before its record persists (the
    job bucket refuses writes meanwhile), so it neither acks nor answers; the next leader gets
    the stored copy again and answers it, once."""
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)  # the redelivery comes fast
    first = await harness.start_broker()
    js = harness.nc.jetstream()
    bucket = await js.stream_info(f"KV_{harness.subjects.jobs_bucket}")
    bucket.config.max_msg_size = 1  # every record write is refused
    await js.update_stream(bucket.config)
    inbox = await Inbox(harness.nc).start()
    await publish(harness, spec("again-1"), inbox, header=inbox.subject)
    machine = first.machine
    assert machine is not None
    await wait_for(lambda: "again-1" in machine.jobs, 10, what="the first delivery processed")
    await wait_for(lambda: first.stats["held_for_storage"] >= 1, 10, what="its record held")
    await harness.crash_broker()
    assert inbox.got == []  # never answered before the record persists
    bucket.config.max_msg_size = -1
    await js.update_stream(bucket.config)
    await harness.start_broker()
    await wait_for(lambda: inbox.got, 20, what="the redelivery answered")
    await settled(harness)
    assert [(r.accepted, r.job_id, r.duplicate) for r in inbox.replies()] == [
        (True, "again-1", False)
    ]


async def test_a_header_naming_a_forbidden_subject_gets_no_reply_and_changes_nothing_else(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    bucket = harness.subjects.jobs_bucket
    overheard: list[Msg] = []

    async def heard(msg: Msg) -> None:
        overheard.append(msg)

    research = harness.subjects.submit("research")
    agent = harness.subjects.agent_cmd("east")
    for watched in (research, agent, f"$KV.{bucket}.forged"):
        await harness.nc.subscribe(watched, cb=heard)
    forbidden = [
        f"$KV.{bucket}.forged",  # the broker's own job records
        research,  # a submission in someone's name
        agent,  # an agent's commands
        "_INBOX",  # an inbox prefix with no inbox under it
        "_INBOX.*",  # a wildcard: not one subject
        "_INBOX. x",  # not a subject at all
        "_INBOX..x",
    ]
    inboxes = []
    for i, header in enumerate(forbidden):
        inbox = await Inbox(harness.nc).start()  # the plain reply: allowed, but not used
        await publish(harness, spec(f"forged-{i}"), inbox, header=header)
        inboxes.append(inbox)
    await processed_with_headers_refused(broker, [f"forged-{i}" for i in range(len(forbidden))])
    machine = broker.machine
    assert machine is not None
    await settled(harness)
    await flush(broker.nc)
    assert overheard == []
    assert [m for inbox in inboxes for m in inbox.got] == []
    assert {r.queue for r in machine.jobs.values()} == {"default"}
    kv = await broker.js.key_value(bucket)
    with pytest.raises(KeyNotFoundError):
        await kv.get("forged")
    metrics = generate_latest(broker.metrics.registry).decode()
    assert f'muster_refused_messages_total{{handler="reply_header"}} {len(forbidden)}.0' in metrics
