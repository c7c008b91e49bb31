"""The hot standby: while it waits for the lease, a standby broker mirrors the job bucket, and
on takeover it restores exactly the newest record of every job, as a cold read would."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import nats
import pytest

from broker.core.effects import Effect
from broker.core.inputs import Input, Restore
from broker.core.machine import Machine
from broker.core.records import record_encoder
from broker.lease import KEY, LeaseHolder
from broker.service import Broker
from broker.store import JobStore, RecordMirror
from tests.broker.conftest import Harness, StartBroker
from tests.broker.jobs import job, stored_record
from tests.support import wait_for


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, bytes]]:
    """The records each new leader restored its machine from, encoded at that moment (the
    machine changes them in place afterwards)."""
    seen: list[dict[str, bytes]] = []
    real = Machine.handle

    def spy(self: Machine, event: Input, now: float) -> list[Effect]:
        if isinstance(event, Restore):
            seen.append({r.job_id: record_encoder.encode(r) for r in event.records})
        return real(self, event, now)

    monkeypatch.setattr(Machine, "handle", spy)
    return seen


def mirror_of(broker: Broker) -> RecordMirror:
    assert broker.mirror is not None, "the standby runs no mirror"
    return broker.mirror


async def bucket(harness: Harness) -> dict[str, bytes]:
    """A fresh cold read of the job bucket, encoded per job."""
    store = JobStore(harness.nc.jetstream(), harness.subjects.jobs_bucket, harness.nc)
    return {r.job_id: record_encoder.encode(r) for r in await store.load_all()}


async def take_over(
    harness: Harness, standby: Broker, restored: list[dict[str, bytes]]
) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Crash the leader (no lease release, like kill -9), read the bucket it left behind, and
    wait for the standby to lead; returns the bucket and what the standby restored. The read
    happens while the crashed leader's lease runs out, so before the new leader writes anything
    (checked: it has not restored yet)."""
    before = len(restored)
    await harness.crash_broker()
    cold = await bucket(harness)
    assert len(restored) == before, "the standby took over before the bucket was read"
    await asyncio.wait_for(standby.leading.wait(), 15)
    assert len(restored) == before + 1
    return cold, restored[before]


async def test_standby_mirror_follows_the_leaders_writes(harness: Harness, brokers: Any) -> None:
    await harness.start_broker()
    standby = await brokers("standby")
    agent = await harness.agent("c1", count=2)
    ids = [(await harness.submit(job(f"m{i}", replicas=1, gpu=8))).job_id for i in range(4)]
    await harness.wait_for(lambda: all("running" in harness.kinds(j) for j in ids[:2]))

    def mirrored(job_id: str, state: str) -> bool:
        record = mirror_of(standby).get(job_id)
        return record is not None and record.state == state

    # Running and queued jobs reach the standby while it stands by, updates included.
    await harness.wait_for(lambda: all(mirrored(j, "running") for j in ids[:2]))
    await harness.wait_for(lambda: all(mirrored(j, "queued") for j in ids[2:]))
    await agent.finish(ids[0], 1)
    await harness.wait_for(lambda: mirrored(ids[0], "succeeded") and mirrored(ids[2], "running"))
    assert not standby.leading.is_set() and standby.machine is None
    assert len(mirror_of(standby)) == 4


async def test_takeover_right_after_a_burst_restores_the_newest_record_of_every_job(
    harness: Harness, brokers: Any, restored: list[dict[str, bytes]]
) -> None:
    await harness.start_broker()
    standby = await brokers("standby")
    await harness.agent("c1", count=4)
    first = [(await harness.submit(job(f"a{i}", replicas=1, gpu=8))).job_id for i in range(6)]
    await harness.wait_for(lambda: all("running" in harness.kinds(j) for j in first[:4]))
    await harness.wait_for(lambda: len(mirror_of(standby)) == 6)
    # A burst the standby can hardly have seen: submissions, admissions, cancellations (of
    # running, queued and just-submitted jobs), and the leader dies as the last is persisted.
    burst = [(await harness.submit(job(f"b{i}", replicas=1, gpu=4))).job_id for i in range(12)]
    for job_id in [first[0], first[1], first[5], burst[3], burst[11]]:
        reply = await harness.api("cancel", {"job_id": job_id})
        assert reply["ok"], reply
    cold, records = await take_over(harness, standby, restored)
    assert len(cold) == 18
    assert records.keys() == cold.keys()
    for job_id, data in cold.items():
        assert records[job_id] == data, job_id
    assert standby.restored_jobs == 18
    assert standby.machine is not None and standby.machine.jobs.keys() == cold.keys()


async def test_a_deleted_record_does_not_come_back(
    harness: Harness, brokers: Any, restored: list[dict[str, bytes]]
) -> None:
    leader = await harness.start_broker()
    standby = await brokers("standby")
    ids = [(await harness.submit(job(f"d{i}", replicas=1, gpu=8))).job_id for i in range(4)]
    for job_id in ids[:2]:
        assert (await harness.api("cancel", {"job_id": job_id}))["ok"]
    await harness.wait_for(lambda: len(mirror_of(standby)) == 4)
    assert leader.store is not None
    # One deletion the standby sees while standing by, one just before the takeover.
    await leader.store.delete(ids[0])
    await harness.wait_for(lambda: mirror_of(standby).get(ids[0]) is None)
    await leader.store.delete(ids[1])
    cold, records = await take_over(harness, standby, restored)
    assert set(records) == set(cold) == set(ids[2:])
    assert standby.machine is not None and set(standby.machine.jobs) == set(ids[2:])


async def test_a_corrupt_record_does_not_stop_the_takeover(
    harness: Harness, brokers: Any, restored: list[dict[str, bytes]]
) -> None:
    await harness.start_broker()
    standby = await brokers("standby")
    ids = [(await harness.submit(job(f"c{i}", replicas=1, gpu=8))).job_id for i in range(3)]
    await harness.wait_for(lambda: len(mirror_of(standby)) == 3)
    js = harness.nc.jetstream()
    prefix = f"$KV.{harness.subjects.jobs_bucket}."
    await js.publish(prefix + "garbage", b"\xc1 not a record")
    # A job whose newest record is corrupt is not restored (a cold read skips it too).
    await js.publish(prefix + ids[0], b"\x93\x01\x02")
    cold, records = await take_over(harness, standby, restored)
    assert set(records) == set(cold) == set(ids[1:])
    assert standby.machine is not None and set(standby.machine.jobs) == set(ids[1:])
    # The new leader serves: it takes a new job.
    assert (await harness.submit(job("after", replicas=1, gpu=8))).accepted


async def test_each_standby_round_mirrors_afresh(
    harness: Harness, brokers: Any, restored: list[dict[str, bytes]]
) -> None:
    """A leader that loses the lease stands by again, behind a new mirror of its own."""
    await harness.start_broker()
    standby = await brokers("standby")
    await harness.submit(job("r0", replicas=1, gpu=8))
    await harness.wait_for(lambda: len(mirror_of(standby)) == 1)
    first = mirror_of(standby)
    await take_over(harness, standby, restored)
    assert standby.mirror is first  # stopped: the leader does not mirror its own writes
    # Another broker takes the lease over (its own holder name lets it reclaim at once).
    lease = await harness.nc.jetstream().key_value(harness.subjects.leader_bucket)
    await lease.put(KEY, msgspec.json.encode(LeaseHolder(holder="other", acquired_at=time.time())))
    other = await brokers("other")
    await asyncio.wait_for(other.leading.wait(), 15)
    await harness.wait_for(lambda: standby.mirror is not None and standby.mirror is not first)
    assert not standby.leading.is_set()
    second = mirror_of(standby)
    reply = await harness.submit(job("r1", replicas=1, gpu=8))
    await harness.wait_for(lambda: second.get(reply.job_id) is not None)
    assert len(second) == 2 and len(first) == 0  # the stopped one holds nothing


async def test_a_mirror_that_lost_its_consumer_catches_up_before_it_answers(nc: Any) -> None:
    """The mirror's consumer vanishes (as in a NATS restart) while records keep changing:
    `caught_up` waits until nats-py has recreated it and the mirror has every newest record."""
    store = await JobStore.open(nc.jetstream(), f"hot{uuid.uuid4().hex[:10]}")
    await store.put_many([stored_record(i) for i in range(50)])
    mirror = RecordMirror(store)
    try:
        assert len(await mirror.caught_up(10)) == 50
        jsm = nc.jetstream()
        for consumer in await jsm.consumers_info(store.stream):
            await jsm.delete_consumer(store.stream, consumer.name)
        await store.put_many([stored_record(i, "cancelled") for i in range(0, 50, 2)])
        await store.put_many([stored_record(i) for i in range(50, 60)])
        for i in range(1, 50, 10):
            await store.delete(f"j{i}")
        records = await mirror.caught_up(30)
        cold = await store.load_all()
        assert len(cold) == 55
        assert sorted(records, key=lambda r: r.job_id) == sorted(cold, key=lambda r: r.job_id)
    finally:
        await mirror.stop()


async def test_a_mirror_rides_out_a_nats_restart(fresh_nats: Any) -> None:
    """NATS restarts (same store) under a running mirror: its consumer is gone with the server,
    nats-py makes a new one after the reconnect, and the mirror ends up with the newest record
    of every job, including those written after the restart."""
    nc = await nats.connect(fresh_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    store = await JobStore.open(nc.jetstream(), "hotrestart")
    mirror = RecordMirror(store)
    try:
        await store.put_many([stored_record(i) for i in range(20)])
        assert len(await mirror.caught_up(10)) == 20
        fresh_nats.stop_sync()
        await wait_for(lambda: not nc.is_connected, 5, what="the client to notice")
        fresh_nats.start_sync()

        async def written() -> bool:
            try:
                await store.put_many([stored_record(i, "cancelled") for i in range(0, 20, 3)], 2)
            except Exception:
                return False  # the client has not reconnected yet
            return True

        await wait_for(written, 30, what="a write after the restart", interval=0.1)
        await store.put_many([stored_record(i) for i in range(20, 25)])
        await store.delete("j1")
        records = await mirror.caught_up(30)
        cold = await store.load_all()
        assert len(cold) == 24 and sum(r.state == "cancelled" for r in cold) == 7
        assert sorted(records, key=lambda r: r.job_id) == sorted(cold, key=lambda r: r.job_id)
    finally:
        await mirror.stop()
        await nc.close()


async def test_a_failed_lease_acquire_is_retried_never_led_on(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An acquire that raises (NATS away mid-request) must not make the broker lead: it stands
    by, tries again, and leads only with a lease it actually won. Both tries fail here: the
    one before mirroring and the standby's first."""
    broker = Broker(harness.config, await nats.connect(harness.url), holder="flaky")
    real = broker.lease.try_acquire
    calls = 0

    async def flaky_try() -> bool:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise ConnectionError("nats: connection closed")
        return await real()

    monkeypatch.setattr(broker.lease, "try_acquire", flaky_try)
    task = asyncio.create_task(broker.run())
    try:
        await asyncio.wait_for(broker.leading.wait(), 15)
        assert calls == 3
        assert await broker.lease.current() == "flaky"
    finally:
        await broker.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15)
        await broker.nc.close()


async def test_a_leader_stopped_cleanly_hands_over_at_once(
    harness: Harness, brokers: StartBroker
) -> None:
    """A clean exit (SIGTERM: `stop`) releases the lease after the leader has stopped
    writing; the standby sees the delete on its watch and leads with every job, without
    waiting out a TTL (two minutes here)."""
    config = msgspec.structs.replace(
        harness.config,
        timeouts=msgspec.structs.replace(harness.config.timeouts, lease_ttl_s=120.0),
    )
    harness.config = config
    await harness.start_broker(config)
    ids = [(await harness.submit(job(f"h{i}", replicas=1, gpu=8))).job_id for i in range(5)]
    standby = await brokers("standby")
    await wait_for(lambda: standby.lease.renewals_seen >= 1, 10, what="the standby's watch")
    await harness.stop_broker()
    await asyncio.wait_for(standby.leading.wait(), 10)
    # Tries: before mirroring, the watch's first, after the delete.
    assert standby.lease.deletes_seen == 1 and standby.lease.attempts == 3
    assert standby.machine is not None
    assert all(standby.machine.jobs.get(i) is not None for i in ids)


async def test_a_broker_that_can_lead_at_once_reads_its_records_after_winning(
    harness: Harness, brokers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted broker (its own identity) takes its lease back before it reads a record: a
    mirror reading 100,000 records first starved the lease's own requests, and the broker then
    waited a whole TTL for its own lease. A broker that cannot lead mirrors while it stands
    by."""
    seen: list[bool] = []  # per mirror, as it first reads: whether its broker held the lease
    # (a standby from `brokers` is not among `running`: False). A mirror reads when it starts
    # following the bucket, or, never started, when asked for its records (one batched read).
    real_start, real_caught_up = RecordMirror.start, RecordMirror.caught_up
    running: list[Broker] = []
    reading: weakref.WeakSet[RecordMirror] = weakref.WeakSet()  # an id may be reused

    def first_read(mirror: RecordMirror) -> None:
        if mirror not in reading:
            reading.add(mirror)
            owner = [b for b in running if b.store is mirror.store]
            seen.append(bool(owner) and owner[0].lease.proven.is_set())

    async def start(self: RecordMirror) -> None:
        first_read(self)
        await real_start(self)

    async def caught_up(self: RecordMirror, timeout: float) -> list[Any]:
        first_read(self)
        return await real_caught_up(self, timeout)

    monkeypatch.setattr(RecordMirror, "start", start)
    monkeypatch.setattr(RecordMirror, "caught_up", caught_up)

    async def run(holder: str) -> tuple[Broker, asyncio.Task[None]]:
        broker = Broker(harness.config, await nats.connect(harness.url), holder=holder)
        running.append(broker)
        task = asyncio.create_task(broker.run())
        await asyncio.wait_for(broker.leading.wait(), 15)
        return broker, task

    first, task = await run("same")
    for i in range(5):
        await harness.submit(job(f"r{i}", replicas=1, gpu=8))
    await first.nc.close()  # like kill -9: no release
    task.cancel()
    await asyncio.wait({task}, timeout=15)
    restarted, task = await run("same")
    try:
        assert restarted.restored_jobs == 5
        assert seen == [True, True]
        standby = await brokers("standby")
        await harness.wait_for(lambda: len(mirror_of(standby)) == 5)
        assert seen == [True, True, False] and not standby.leading.is_set()
    finally:
        await restarted.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15)
        await restarted.nc.close()


async def test_a_standby_reads_the_bucket_with_the_cycle_collector_paused(
    harness: Harness, brokers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read of the bucket by a standby runs with the cycle collector paused (it
    more than doubled the read's CPU at 100,000 records), and the collector runs again once
    the records are read, while the standby goes on standing by."""
    await harness.start_broker()
    for i in range(6):
        await harness.submit(job(f"g{i}", replicas=1, gpu=8))
    taken: dict[int, list[bool]] = {}  # per mirror: was the collector on at each record
    real = RecordMirror.taker

    def taker(self: RecordMirror) -> Callable[[Any, int], None]:
        take = real(self)

        def spy(msg: Any, seq: int) -> None:
            taken.setdefault(id(self), []).append(gc.isenabled())
            take(msg, seq)

        return spy

    monkeypatch.setattr(RecordMirror, "taker", taker)
    assert gc.isenabled()
    standby = await brokers("standby")
    await harness.wait_for(lambda: len(mirror_of(standby)) == 6)
    await harness.wait_for(gc.isenabled)
    first = taken[id(mirror_of(standby))]
    assert len(first) >= 6 and not any(first[:6])
    assert not standby.leading.is_set()
    await harness.submit(job("after", replicas=1, gpu=8))
    await harness.wait_for(lambda: len(mirror_of(standby)) == 7)
    assert taken[id(mirror_of(standby))][-1] is True
