"""Job records written to a real nats-server: many at once go as one fast-ingest batch (nats
ADR-50) that the server answers a few times instead of once a record, and every way it can
refuse them is an error the caller sees, never records silently missing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from broker import store as store_module
from broker.core.records import JobRecord, record_encoder
from broker.store import JobStore, RecordMirror, StoreError, kv_stream_config, open_bucket
from schemas.config import Replication
from tests.broker.jobs import stored_record

MANY = 500


@pytest.fixture
async def own(nats_url: str) -> AsyncIterator[Client]:
    """A connection of the store's own, so that its counts are the store's messages only."""
    client = await nats.connect(nats_url)
    yield client
    await client.close()


def bucket() -> str:
    return f"w{uuid.uuid4().hex[:8]}"


def encoded(records: list[JobRecord]) -> dict[str, bytes]:
    return {r.job_id: record_encoder.encode(r) for r in records}


async def followed_records(store: JobStore) -> dict[str, bytes]:
    """What a mirror of the bucket reads back, by job."""
    mirror = RecordMirror(store)
    try:
        return encoded(await mirror.caught_up(60))
    finally:
        await mirror.stop()


async def test_many_records_go_as_one_batch_the_server_answers_a_few_times(own: Client) -> None:
    store = await JobStore.open(own.jetstream(), bucket(), 1, own)
    records = [stored_record(i) for i in range(MANY)]
    before = own.stats["in_msgs"]
    await store.put_many(records)
    answers = own.stats["in_msgs"] - before
    assert answers <= MANY // store_module.FAST_FLOW + 2
    assert await followed_records(store) == encoded(records)
    assert store.acked_seq == MANY


async def test_a_few_records_are_each_answered(own: Client) -> None:
    store = await JobStore.open(own.jetstream(), bucket(), 1, own)
    few = [stored_record(i) for i in range(store_module.FAST_BATCH_MIN - 1)]
    before = own.stats["in_msgs"]
    await store.put_many(few)
    assert own.stats["in_msgs"] - before == len(few)
    assert await followed_records(store) == encoded(few)


async def test_a_bucket_an_earlier_release_made_takes_batches_once_opened(own: Client) -> None:
    js, name, one = own.jetstream(), bucket(), Replication(replicas=1)
    await open_bucket(js, kv_stream_config(name, one), one)
    assert not (await js.stream_info(f"KV_{name}")).config.allow_batched
    store = await JobStore.open(js, name, one, own)
    assert store.fast_ingest and (await js.stream_info(f"KV_{name}")).config.allow_batched
    before = own.stats["in_msgs"]
    await store.put_many([stored_record(i) for i in range(MANY)])
    assert own.stats["in_msgs"] - before <= MANY // store_module.FAST_FLOW + 2


async def test_a_batch_the_bucket_cannot_hold_is_refused_saying_why(own: Client) -> None:
    """The bucket fills mid-batch: the put fails with the server's reason (the broker's
    storage-full check reads it), and what was stored is the batch's first records, in
    order, with none after a gap."""
    records = [stored_record(i) for i in range(MANY)]
    room = 100 * (len(record_encoder.encode(records[0])) + 60)  # about a hundred
    store = await JobStore.open(own.jetstream(), bucket(), 1, own, max_bytes=room)
    with pytest.raises(StoreError, match="maximum bytes exceeded"):
        await store.put_many(records)
    held = await followed_records(store)
    assert 0 < len(held) < MANY
    assert set(held) == {r.job_id for r in records[: len(held)]}


async def test_a_stream_that_stops_taking_batches_gets_the_records_one_by_one(
    own: Client,
) -> None:
    store = await JobStore.open(own.jetstream(), bucket(), 1, own)
    js = own.jetstream()
    config = (await js.stream_info(store.stream)).config
    config.allow_batched = False  # an operator turns it off
    await js.update_stream(config)
    records = [stored_record(i) for i in range(MANY)]
    await store.put_many(records)
    assert not store.fast_ingest
    assert await followed_records(store) == encoded(records)


async def test_a_record_lost_on_the_way_fails_the_batch_and_the_retry_stores_all(
    own: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record of the batch never reaches the server: the server sees a gap and ends the
    batch there (gap mode "fail"), the put fails, and nothing after the gap is stored; put
    again, every record is."""
    store = await JobStore.open(own.jetstream(), bucket(), 1, own)
    records = [stored_record(i) for i in range(MANY)]
    lost = records[149].job_id
    publish = own.publish

    async def losing(subject: str, *args: Any, **kwargs: Any) -> None:
        if not subject.endswith(f".{lost}"):
            await publish(subject, *args, **kwargs)

    monkeypatch.setattr(own, "publish", losing)
    with pytest.raises(StoreError):
        await store.put_many(records, timeout=5)
    held = await followed_records(store)
    assert set(held) <= {r.job_id for r in records[:149]}
    monkeypatch.setattr(own, "publish", publish)
    await store.put_many(records)
    assert await followed_records(store) == encoded(records)
