"""Deferred record writes over a real NATS server: the dispatch's ack and the attempt found
running reach the job bucket within `timeouts.deferred_write_s`, or with the job's next urgent
write; a broker killed before they land leaves records its successor handles, with the job's
one attempt left running (no second copy, nothing healthy cancelled)."""

from __future__ import annotations

import copy

from broker.core.records import JobRecord
from broker.store import JobStore
from schemas.config import BrokerConfig
from tests.broker.conftest import Harness
from tests.broker.jobs import job
from tests.broker.wire import next_item
from tests.support import wait_for


def deferring(harness: Harness, seconds: float) -> BrokerConfig:
    config = copy.deepcopy(harness.config)
    config.timeouts.deferred_write_s = seconds
    config.timeouts.start_s = 120.0
    return config


async def stored(store: JobStore, job_id: str) -> JobRecord:
    records = {r.job_id: r for r in await store.load_all(10)}
    return records[job_id]


async def test_the_running_write_lands_within_its_bound(harness: Harness) -> None:
    broker = await harness.start_broker(deferring(harness, 3.0))
    await harness.agent("c1")
    reply = await harness.submit(job("lazy", replicas=1, gpu=1))
    await harness.wait_event(reply.job_id, "running", timeout=10)
    store = broker.store
    assert store is not None
    # Told running, not yet written: the dispatch's record is what the bucket holds.
    early = await stored(store, reply.job_id)
    assert early.state == "admitted" and early.attempts[-1].running_at is None

    async def written() -> bool:
        rec = await stored(store, reply.job_id)
        return rec.state == "running" and rec.attempts[-1].acked_at is not None

    await wait_for(written, 3.0 + 10, what="the deferred running write in the bucket")
    assert broker.stats["records_put"] >= 2  # the dispatch's write, then the deferred one


async def test_an_urgent_write_carries_the_deferred_change(harness: Harness) -> None:
    """With a bound longer than the test, only the cancel's own write can bring the attempt's
    running time to the bucket."""
    broker = await harness.start_broker(deferring(harness, 10.0))
    await harness.agent("c1")
    reply = await harness.submit(job("carried", replicas=1, gpu=1))
    await harness.wait_event(reply.job_id, "running", timeout=10)
    store = broker.store
    assert store is not None
    assert (await stored(store, reply.job_id)).attempts[-1].running_at is None
    assert (await harness.api("cancel", {"job_id": reply.job_id}))["ok"]

    async def cancelled() -> bool:
        return (await stored(store, reply.job_id)).state == "cancelled"

    await wait_for(cancelled, 10, what="the cancel's write")
    rec = await stored(store, reply.job_id)
    assert rec.attempts[-1].running_at is not None and rec.attempts[-1].acked_at is not None


async def test_a_crash_before_the_deferred_write_keeps_the_one_attempt(
    harness: Harness,
) -> None:
    config = deferring(harness, 10.0)
    broker = await harness.start_broker(config)
    agent = await harness.agent("c1")
    reply = await harness.submit(job("survivor", replicas=1, gpu=1))
    first = await next_item(agent.dispatches)
    await harness.wait_event(reply.job_id, "running", timeout=10)
    store = broker.store
    assert store is not None
    lost = await stored(store, reply.job_id)
    assert lost.state == "admitted" and lost.attempts[-1].acked_at is None
    await harness.crash_broker()

    broker = await harness.start_broker(config)
    # The dispatch persisted without its ack is sent again: the same attempt, which the
    # agent already runs; its snapshot says running.
    again = await next_item(agent.dispatches, 10)
    assert (again.job_id, again.attempt) == (first.job_id, first.attempt)

    def running_again() -> bool:
        machine = broker.machine
        return machine is not None and machine.jobs[reply.job_id].state == "running"

    await harness.wait_for(running_again, 10)
    machine = broker.machine
    assert machine is not None
    record = machine.jobs[reply.job_id]
    assert [a.attempt for a in record.attempts] == [1] and record.attempts[0].live
    assert agent.cancels.empty()
    assert [w.attempt for w in agent.workloads if w.job_id == reply.job_id] == [1]
