"""The running broker honours the sequencer's Cancel-before-Dispatch barrier over NATS: the
replacement of a noticed attempt is not sent to the other cluster while the old attempt's agent
leaves its Cancel unanswered (the Cancel is asked again meanwhile), and goes out once that
Cancel is acknowledged; an acknowledgement that carries the old attempt's success keeps it
from leaving at all."""

from __future__ import annotations

import time

from schemas.agent import Cancel, CommandAck, Dispatch, SpotNotice, WorkloadStatus
from schemas.codec import decode_command, encode_msgpack
from tests.broker.conftest import OD_A100, SPOT_A100, Harness
from tests.broker.jobs import job
from tests.broker.wire import WireAgent, next_item
from tests.support import wait_for


async def running_on_spot(h: Harness, name: str) -> tuple[WireAgent, str, Dispatch]:
    """A job running on c1's spot node: (c1's agent, the job, its first Dispatch)."""
    await h.start_broker()
    old = await h.agent("c1", [SPOT_A100], count=1)
    reply = await h.submit(job(name, replicas=1, gpu=8))
    assert reply.accepted, reply.error
    first: Dispatch = await next_item(old.dispatches)
    assert first.attempt == 1
    await h.wait_event(reply.job_id, "running")
    return old, reply.job_id, first


async def test_a_replacement_waits_until_the_old_attempts_cancel_is_heard(
    harness: Harness,
) -> None:
    h = harness
    old, job_id, first = await running_on_spot(h, "b")
    new = await h.agent("c2", [OD_A100], count=1)
    old.ack = False  # the old attempt's agent hears commands but answers none
    node = first.assignment[0].nodes[0]
    await old.send(SpotNotice(node=node, deadline=time.time() + 0.5))

    def cancels() -> list[Cancel]:
        return [c for c in old.commands if isinstance(c, Cancel) and c.attempt == 1]

    # The Cancel is asked again (copies, then a new round) while nobody answers it ...
    await wait_for(lambda: len(cancels()) > 3, 20, what="a second round of the Cancel")
    # ... and all that time the replacement is held back.
    assert new.dispatches.empty(), "the replacement left before the Cancel was heard"
    assert h.broker is not None
    assert [h.command.attempt for h in h.broker.held_dispatches()] == [2]
    old.ack = True
    for msg in list(old.unanswered):
        if isinstance(decode_command(msg.data), Cancel):
            await msg.respond(encode_msgpack(CommandAck(ok=True)))
    second: Dispatch = await next_item(new.dispatches, timeout=10)
    assert (second.job_id, second.attempt) == (job_id, 2)


async def test_an_ending_in_the_cancels_answer_keeps_the_replacement_from_leaving(
    harness: Harness,
) -> None:
    """The attempt succeeded just before its node's spot notice, and the batch that says so
    has not come: the agent's answer to the Cancel carries the ending. The job ends
    succeeded, and the replacement the Cancel held never reaches the other cluster; its
    Cancel does (the replacement's agent refuses it should it come late)."""
    h = harness
    old, job_id, first = await running_on_spot(h, "e")
    new = await h.agent("c2", [OD_A100], count=1)
    ended = WorkloadStatus(job_id=job_id, attempt=1, phase="succeeded")
    old.ended[(job_id, 1)] = ended  # its batch is not sent: the answer alone tells it
    await old.send(SpotNotice(node=first.assignment[0].nodes[0], deadline=time.time() + 0.5))
    held = await next_item(old.cancels)
    assert held.attempt == 1
    await h.wait_event(job_id, "succeeded")
    assert h.broker is not None
    cancel: Cancel = await next_item(new.cancels)
    assert (cancel.job_id, cancel.attempt) == (job_id, 2)
    assert h.broker.held_dispatches() == []
    assert new.dispatches.empty() and not [c for c in new.commands if isinstance(c, Dispatch)]
