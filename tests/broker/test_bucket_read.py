"""The one-time read of the job bucket (`broker.bucketread`, a restart's and a backup's) takes
exactly what the live mirror takes: the same newest record per job, deletes and purges
honoured, a corrupt record skipped, a record of a newer format kept out."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker import bucketread
from broker.bucketread import StreamMissing
from broker.core.records import RECORD_FORMAT
from broker.store import JobStore, RecordMirror
from tests.broker.jobs import KEYS, filled, record
from tests.broker.jobs import mirror_took as taken


async def test_the_batched_read_takes_what_the_live_mirror_takes(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bucketread, "BATCH", 1000)  # twelve pull requests, two at a time
    store, fate = await filled(nc)
    live = RecordMirror(store)
    await live.start()  # following the bucket: the ordered consumer
    by_mirror = taken(live, await live.caught_up(60))
    await live.stop()
    once = RecordMirror(store)  # never started: one batched read
    by_read = taken(once, await once.caught_up(60))
    await once.stop()

    assert by_read == by_mirror
    records = by_read["records"]
    gone = {j for j, kind in fate.items() if kind != "updated"}
    assert set(records) == {f"j{i}" for i in range(KEYS)} - gone
    for job_id, kind in fate.items():
        if kind == "updated":
            assert msgspec.msgpack.decode(records[job_id])["state"] == "running"
    newer = {store.prefix + j for j, kind in fate.items() if kind == "newer"}
    assert by_read["too_new"] == dict.fromkeys(newer, RECORD_FORMAT + 1)
    assert sum(by_read["active"].values()) == len(records)
    # The read's consumer is gone with it: nothing is left on the server.
    assert not await store.js.consumers_info(store.stream)


async def test_a_read_whose_consumer_is_deleted_reads_on(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its consumer deleted mid-read (a stream leader lost it), the read neither waits out its
    time nor returns some records as all of them: a new consumer reads on from the sequence
    after the last one taken, and the read ends with what the live mirror holds. The consumer
    is deleted at the first record, with at most two batches asked for."""
    monkeypatch.setattr(bucketread, "BATCH", 50)
    js = nc.jetstream()
    store = await JobStore.open(js, f"read{uuid.uuid4().hex[:8]}")
    for at in range(0, 2000, 500):
        await store.put_many([record(f"j{i}", order=i) for i in range(at, at + 500)])
    live = RecordMirror(store)
    await live.start()
    by_mirror = taken(live, await live.caught_up(60))
    await live.stop()

    once = RecordMirror(store)
    consumers: list[str] = []  # in the order they delivered
    seen: list[int] = []
    deleting: list[asyncio.Task[bool]] = []
    taker = once.taker

    def deleting_taker() -> Any:
        inner = taker()

        def take(msg: Msg, seq: int) -> None:
            name = msg.reply.split(".")[3]  # $JS.ACK.<stream>.<consumer>...
            if name not in consumers:
                consumers.append(name)
            seen.append(seq)
            if not deleting:
                deleting.append(asyncio.ensure_future(js.delete_consumer(store.stream, name)))
            inner(msg, seq)

        return take

    monkeypatch.setattr(once, "taker", deleting_taker)
    by_read = taken(once, await once.caught_up(30))
    await once.stop()

    assert await deleting[0]
    assert len(consumers) >= 2, "the read went on with a new consumer"
    assert by_read == by_mirror and len(by_read["records"]) == 2000
    assert seen == sorted(seen) and len(seen) == len(set(seen))  # each record once, in order
    assert not await js.consumers_info(store.stream)


async def test_a_read_of_a_stream_deleted_under_it_says_so(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream deleted mid-read (its pull requests end, its leader answers no more): the
    read raises at once instead of waiting out its time or returning some records."""
    monkeypatch.setattr(bucketread, "BATCH", 50)
    js = nc.jetstream()
    store = await JobStore.open(js, f"read{uuid.uuid4().hex[:8]}")
    await store.put_many([record(f"j{i}", order=i) for i in range(500)])
    seen: list[int] = []
    deleting: list[asyncio.Task[bool]] = []

    def take(msg: Msg, seq: int) -> None:
        seen.append(seq)
        if not deleting:
            deleting.append(asyncio.ensure_future(js.delete_stream(store.stream)))

    never = asyncio.get_running_loop().create_future()  # the read must end on its own
    with pytest.raises(StreamMissing, match="does not exist"):
        async with asyncio.timeout(20):
            await bucketread.read_newest(js, store.stream, store.prefix + ">", take, never, 60)
    assert await deleting[0]
    assert seen and seen == sorted(seen)
