"""Deferred record writes over a real NATS server: the attempt found running reaches the job
bucket within `timeouts.deferred_write_s`, or with the job's next urgent write; a broker killed
before it lands leaves records its successor handles, with the job's one attempt left running
(no second copy, nothing healthy cancelled)."""

from __future__ import annotations

import copy
import time

import pytest
import structlog
from nats.js.errors import KeyNotFoundError

from broker.core.records import JobRecord
from broker.lease import KEY
from broker.store import JobStore
from schemas.agent import Dispatch, WorkloadStatus
from schemas.config import BrokerConfig
from tests.broker.conftest import Harness
from tests.broker.jobs import job
from tests.broker.wire import WireAgent, next_item
from tests.support import wait_for


def deferring(harness: Harness, seconds: float) -> BrokerConfig:
    config = copy.deepcopy(harness.config)
    config.timeouts.deferred_write_s = seconds
    config.timeouts.start_s = 120.0
    return config


async def stored(store: JobStore, job_id: str) -> JobRecord:
    records = {r.job_id: r for r in await store.load_all(10)}
    return records[job_id]


async def running_after_ack(harness: Harness, agent: WireAgent, name: str) -> tuple[str, JobStore]:
    """A job the agent acknowledges, whose ack is written, and which then reports running: the
    running write is the deferred one, nothing else of the job's pending."""
    agent.auto_run = False
    reply = await harness.submit(job(name, replicas=1, gpu=1))
    cmd: Dispatch = await next_item(agent.dispatches)
    broker = harness.broker
    assert broker is not None and broker.store is not None
    store = broker.store

    async def acked() -> bool:
        return (await stored(store, reply.job_id)).attempts[-1].acked_at is not None

    await wait_for(acked, 10, what="the dispatch's ack in the bucket")
    status = WorkloadStatus(
        job_id=cmd.job_id,
        attempt=cmd.attempt,
        phase="running",
        running_replicas=1,
        total_replicas=1,
    )
    agent.workloads.append(status)  # listed in its snapshots from now on
    await agent.send(status)
    await harness.wait_event(reply.job_id, "running", timeout=10)
    return reply.job_id, store


async def test_the_running_write_lands_within_its_bound(harness: Harness) -> None:
    broker = await harness.start_broker(deferring(harness, 3.0))
    agent = await harness.agent("c1")
    job_id, store = await running_after_ack(harness, agent, "lazy")
    # Told running, not yet written: the acknowledged dispatch is what the bucket holds.
    early = await stored(store, job_id)
    assert early.state == "admitted" and early.attempts[-1].running_at is None

    async def written() -> bool:
        return (await stored(store, job_id)).state == "running"

    await wait_for(written, 3.0 + 10, what="the deferred running write in the bucket")
    assert broker.stats["records_put"] >= 3  # the dispatch's, the ack's, the deferred one


async def test_an_urgent_write_carries_the_deferred_change(harness: Harness) -> None:
    """With a bound longer than the test, only the cancel's own write can bring the attempt's
    running time to the bucket."""
    await harness.start_broker(deferring(harness, 10.0))
    agent = await harness.agent("c1")
    job_id, store = await running_after_ack(harness, agent, "carried")
    assert (await stored(store, job_id)).attempts[-1].running_at is None
    assert (await harness.api("cancel", {"job_id": job_id}))["ok"]

    async def cancelled() -> bool:
        return (await stored(store, job_id)).state == "cancelled"

    await wait_for(cancelled, 10, what="the cancel's write")
    assert (await stored(store, job_id)).attempts[-1].running_at is not None


async def test_a_crash_before_the_deferred_write_keeps_the_one_attempt(
    harness: Harness,
) -> None:
    """Restored past the attempt's start timeout with no record of it running: the start
    timeout waits for the agent's snapshot, which says it runs."""
    config = deferring(harness, 10.0)
    config.timeouts.start_s = 1.0
    await harness.start_broker(config)
    agent = await harness.agent("c1")
    job_id, store = await running_after_ack(harness, agent, "survivor")
    lost = await stored(store, job_id)
    assert lost.state == "admitted" and lost.attempts[-1].running_at is None
    await harness.crash_broker()
    await wait_for(lambda: time.time() - lost.attempts[-1].dispatched_at > 1.5, 10)

    broker = await harness.start_broker(config)

    def running_again() -> bool:
        machine = broker.machine
        return machine is not None and machine.jobs[job_id].state == "running"

    await harness.wait_for(running_again, 10)
    machine = broker.machine
    assert machine is not None
    record = machine.jobs[job_id]
    assert [a.attempt for a in record.attempts] == [1] and record.attempts[0].live
    assert agent.cancels.empty() and agent.dispatches.empty()
    assert [w.attempt for w in agent.workloads if w.job_id == job_id] == [1]


async def test_a_clean_stop_writes_what_it_deferred(harness: Harness) -> None:
    """A broker stopped while leading writes the attempt found running before it lets the
    lease go, long before the deferred write would have fallen due."""
    await harness.start_broker(deferring(harness, 30.0))
    agent = await harness.agent("c1")
    job_id, store = await running_after_ack(harness, agent, "handed-over")
    assert (await stored(store, job_id)).attempts[-1].running_at is None
    await harness.stop_broker()
    after = await stored(JobStore(harness.nc.jetstream(), store.bucket), job_id)
    assert after.state == "running" and after.attempts[-1].running_at is not None


async def test_a_clean_stop_whose_writes_cannot_land_still_lets_the_lease_go(
    harness: Harness,
) -> None:
    """The job bucket refuses every write (a sealed stream; the write is retried): the stop gives up
    on the deferred write after its bound, says so, and still releases the lease, so a
    standby does not wait out the TTL."""
    await harness.start_broker(deferring(harness, 30.0))
    agent = await harness.agent("c1")
    await running_after_ack(harness, agent, "unwritable")
    js = harness.nc.jetstream()
    stream = f"KV_{harness.subjects.jobs_bucket}"
    sealed = (await js.stream_info(stream)).config
    sealed.sealed = True  # the server refuses every write from now on ("stream sealed")
    await js.update_stream(sealed)
    with structlog.testing.capture_logs() as logs:
        await harness.stop_broker()
    gave_up = [e for e in logs if e["event"] == "broker.handover_drain_timed_out"]
    assert gave_up and gave_up[0]["unwritten"] >= 1, "\n".join(str(e) for e in logs)
    lease = await js.key_value(harness.subjects.leader_bucket)
    with pytest.raises(KeyNotFoundError):  # deleted: nobody holds it
        await lease.get(KEY)
