"""A squatter who could predict the id a victim's submission will get could submit that id
first, and the victim's job would be answered "duplicate" and never exist. Server-derived ids
are keyed with the submit stream's secret, which no client can read, so the victim's id is
known only once the broker answers.

Each test computes the guess exactly as the broker builds the id, from the same basis, and
runs once more as a squatter who has the key (read from the stream's metadata, as if it had
leaked): that control proves the guess WOULD match with the key, so the key's secrecy is what
stops it (and the test fails if the broker drops the key)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from broker.core.submission import derive_job_id
from broker.process import ID_KEY
from schemas.codec import decode_submit_reply, encode_json
from tests.broker.conftest import Harness
from tests.support import wait_for

KEYED = pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "control-key-leaked"])


def _token(basis: str, key: bytes) -> str:
    return hashlib.blake2b(basis.encode(), key=key, digest_size=6).hexdigest()


def _job(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "gang": [{"name": "worker", "replicas": 1, "gpu": 1}], **extra}


async def _start(h: Harness, keyed: bool) -> tuple[Any, bytes]:
    """The broker, and the key the squatter guesses with: none, or (the control) the stream's
    own secret."""
    broker = await h.start_broker()
    if keyed:
        return broker, b""
    info = await h.nc.jetstream().stream_info(h.subjects.submit_stream)
    return broker, (info.config.metadata or {})[ID_KEY].encode()


@KEYED
async def test_a_squatter_cannot_take_the_id_a_known_msg_id_would_get(
    harness: Harness, keyed: bool
) -> None:
    """The id of a submission with a Nats-Msg-Id comes from the subject and that header, both
    of which a squatter may know (a client that derives its Msg-Id from the job, a log)."""
    h = harness
    broker, key = await _start(h, keyed)
    subject = h.subjects.submit("default")
    msg_id = "victim-nightly-2026-12-01"
    guess = derive_job_id("victim", _token(f"id:{subject}:{msg_id}", key))
    assert (await h.submit(_job("squat", job_id=guess))).accepted

    msg = await h.nc.request(
        subject, encode_json(_job("victim")), timeout=10, headers={"Nats-Msg-Id": msg_id}
    )
    reply = decode_submit_reply(msg.data)
    jobs = broker.machine.jobs
    if keyed:
        assert reply.accepted and not reply.duplicate, reply
        assert reply.job_id != guess
        assert jobs[reply.job_id].spec.name == "victim"
    else:
        # With the key the squatter's guess is the victim's id: the victim is told
        # "duplicate" and its job never exists.
        assert reply.job_id == guess and reply.duplicate, reply
        assert not any(r.spec.name == "victim" for r in jobs.values())
    assert jobs[guess].spec.name == "squat"


@KEYED
async def test_the_stream_sequence_and_stored_time_do_not_give_the_id_away(
    harness: Harness, keyed: bool
) -> None:
    """Without a Nats-Msg-Id the basis is the stream sequence and the stored-at time. A
    squatter can predict the sequence and may learn the time (the broker's acks carry both, on
    the wire, as seen here); the id must still not follow from them."""
    h = harness
    broker, key = await _start(h, keyed)
    stream = h.subjects.submit_stream
    acked: dict[int, int] = {}  # stream sequence -> stored-at ns, read from the broker's acks

    async def on_ack(msg: Any) -> None:
        tokens = msg.subject.split(".")  # $JS.ACK.<stream>.<consumer>.<n>.<sseq>.<cseq>.<ts>...
        acked[int(tokens[5])] = int(tokens[7])

    await h.nc.subscribe(f"$JS.ACK.{stream}.>", cb=on_ack)
    await h.nc.flush()
    nxt = (await h.nc.jetstream().stream_info(stream)).state.last_seq + 1
    squats = 2  # the squatter's own submissions take the next sequence numbers first
    for i in range(squats):
        assert (await h.submit(_job("squat", job_id=f"squat-{i}"))).accepted
    replies = [await h.submit(_job("victim")) for _ in range(3)]
    assert all(r.accepted and not r.duplicate for r in replies), replies
    predicted = [nxt + squats + i for i in range(3)]
    await wait_for(lambda: all(s in acked for s in predicted), 10, what="the broker's acks")
    guesses = [derive_job_id("victim", _token(f"seq:{s}:{acked[s]}", key)) for s in predicted]
    ids = [r.job_id for r in replies]
    assert all(broker.machine.jobs[i].spec.name == "victim" for i in ids)
    if keyed:
        assert not set(ids) & set(guesses), (ids, guesses)
    else:
        assert ids == guesses  # the guess is the real basis: only the key stands in the way
