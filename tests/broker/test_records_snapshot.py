"""A restart's read begun from the job bucket's snapshot (broker/snapshot.py) restores exactly
what a read of every record restores, and one the stream contradicts is never used: a key
purged without a marker, a stream made again, a snapshot that cannot be read."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, ServiceUnavailableError
from structlog.testing import capture_logs

from broker import snapshot, snapshotwriter
from broker.core import storedrecord
from broker.core.records import JobRecord
from broker.service import Broker
from broker.snapshot import OBJECT, RecordSnapshot, objects_stream
from broker.snapshotwriter import SnapshotJob, Snapshots, write_snapshot
from broker.store import KV_OP, JobStore, RecordMirror
from schemas.config import BrokerConfig
from schemas.job import JobSpec, PodSet
from schemas.natsopts import NatsOptions
from schemas.subjects import snapshot_bucket_of
from tests.broker.conftest import Harness
from tests.broker.jobs import CHANGES, change, filled, job, record
from tests.broker.jobs import mirror_took as taken
from tests.support import wait_for


async def read_all(store: JobStore) -> tuple[dict[str, Any], RecordMirror]:
    """What a restart's read takes (and the mirror that took it)."""
    mirror = RecordMirror(store)
    got = taken(mirror, await mirror.caught_up(60))
    await mirror.stop()
    return got, mirror


async def followed(store: JobStore) -> dict[str, Any]:
    """What a standby's mirror, following the bucket from its start, holds: no snapshot."""
    live = RecordMirror(store)
    await live.start()
    got = taken(live, await live.caught_up(60))
    await live.stop()
    return got


async def change_some(store: JobStore, rng: random.Random, keys: int, n: int) -> None:
    """Write after the snapshot: updates, deletes, purges with a marker, corrupt records,
    records of a newer format and new jobs."""
    for i in rng.sample(range(keys), n):
        kind = rng.choice([*CHANGES, "new"])
        if kind == "new":
            await store.put(record(f"new{i}", order=keys + i))
        else:
            await change(store, f"j{i}", i, kind)


async def test_a_read_from_the_snapshot_restores_what_a_whole_read_restores(nc: Client) -> None:
    store, _ = await filled(nc)
    written = await write_snapshot(store)
    assert written is not None
    info = await store.js.stream_info(store.stream)
    assert written.last_seq == info.state.last_seq and written.keys == info.state.messages
    await change_some(store, random.Random(5), 12_000, 300)

    got, mirror = await read_all(store)

    assert mirror.from_snapshot and mirror.snapshot_seq == written.last_seq
    assert got == await followed(store)
    assert got["applied"] == (await store.js.stream_info(store.stream)).state.last_seq


async def test_records_the_shared_parts_decode_refuses_are_restored_and_reported(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the restart's shared-parts decode (broker/core/storedrecord.py) refuse records
    that are whole, they are restored all the same, by the plain decoder, and the restart
    says how many in one warning: a fault that would otherwise show only as a slow restart."""
    store = await JobStore.open(nc.jetstream(), f"plain{uuid.uuid4().hex[:8]}")
    odd = PodSet(name=f"w{uuid.uuid4().hex[:8]}", gpu=8)  # a gang no earlier read has seen
    odd_ones = [
        JobRecord(
            job_id=f"odd{i}",
            spec=JobSpec(name="r", gang=[odd]),
            queue="q0",
            order=i,
            submitted_at=1.0,
            state="queued",
        )
        for i in range(5)
    ]
    await store.put_many([record(f"j{i}", order=i) for i in range(20)] + odd_ones)
    share = dict(storedrecord.SHARE_PART)

    def refuse_the_odd_gang(value: Any) -> Any:
        if value and value[0].name == odd.name:
            raise ValueError("refused")
        return share["gang"](value)

    monkeypatch.setattr(storedrecord, "SHARE_PART", share | {"gang": refuse_the_odd_gang})
    with capture_logs() as logs:
        got, _ = await read_all(store)
    monkeypatch.undo()

    assert got == await followed(store)
    plainly = [e for e in logs if e["event"] == "store.records_decoded_plainly"]
    assert [e["records"] for e in plainly] == [len(odd_ones)], logs


async def test_a_restart_before_any_snapshot_reads_every_record_and_warns_of_nothing(
    nc: Client,
) -> None:
    """No snapshot written yet (a new bucket, snapshots off) is the usual case, not a fault."""
    store, _ = await filled(nc)
    with capture_logs() as logs:
        got, mirror = await read_all(store)
    assert not mirror.from_snapshot and got == await followed(store)
    assert [e for e in logs if e["log_level"] == "warning"] == []


async def test_a_snapshot_of_the_newest_sequence_is_read_alone(nc: Client) -> None:
    store, _ = await filled(nc)
    await write_snapshot(store)
    _, mirror = await read_all(store)
    assert mirror.from_snapshot
    assert await followed(store) == (await read_all(store))[0]


async def test_a_key_purged_without_a_marker_after_the_snapshot_is_not_restored(
    nc: Client,
) -> None:
    """`muster store-compact` purges ended jobs' keys outright: the snapshot still holds
    them, and no later message says they are gone. The keys no longer add up, so the
    snapshot is not used and every record is read."""
    store, _ = await filled(nc)
    await write_snapshot(store)
    await store.put(record("late", order=99_999))
    await store.js.purge_stream(store.stream, subject=store.prefix + "j17")

    with capture_logs() as logs:
        got, mirror = await read_all(store)

    assert not mirror.from_snapshot
    assert "j17" not in got["records"] and "late" in got["records"]
    assert got == await followed(store)
    unused = [e for e in logs if e["event"] == "store.snapshot_unused"]
    assert unused and "keys" in unused[0]["why"]


async def test_a_snapshot_of_a_stream_made_again_is_not_used(nc: Client) -> None:
    store, _ = await filled(nc)
    await write_snapshot(store)
    await store.js.delete_stream(store.stream)
    store = await JobStore.open(store.js, store.bucket)
    for i in range(20):  # fewer writes than the snapshot held: its sequences are ahead
        await store.put(record(f"k{i}", order=i))

    with capture_logs() as logs:
        got, mirror = await read_all(store)

    assert not mirror.from_snapshot
    assert set(got["records"]) == {f"k{i}" for i in range(20)}
    assert any(e["event"] == "store.snapshot_unused" and "made again" in e["why"] for e in logs)


async def test_the_newest_snapshots_sequence_is_read_from_its_description(nc: Client) -> None:
    """What a new leader counts its next snapshot from: the snapshot's own sequence, or 0
    when there is none, the stream was made again after it (its sequences restarted), or it
    does not say (written without the headers)."""
    store, _ = await filled(nc)
    bucket = snapshot_bucket_of(store.bucket)

    async def known() -> int:
        info = await store.js.stream_info(store.stream)
        return await snapshot.written_seq(store.js, bucket, info, 5.0)

    assert await known() == 0
    written = await write_snapshot(store)
    assert written is not None
    await store.put(record("late", order=99_999))
    assert await known() == written.last_seq
    await store.js.delete_stream(store.stream)
    store = await JobStore.open(store.js, store.bucket)
    # Past the snapshot's sequence: only when each stream was made tells them apart.
    await store.put_many([record(f"k{i}", order=i) for i in range(written.last_seq + 5)])
    assert await known() == 0

    # A snapshot of the new stream counts; one that says nothing of itself (an earlier
    # release's) counts as none.
    again = await write_snapshot(store)
    assert again is not None and await known() == again.last_seq
    objects = await store.js.object_store(bucket)
    await objects.put(OBJECT, (await objects.get(OBJECT)).data or b"")
    assert await known() == 0


@pytest.mark.parametrize("damage", ["not a snapshot", "columns", "format"])
async def test_a_snapshot_that_cannot_be_read_is_not_used(nc: Client, damage: str) -> None:
    store, _ = await filled(nc)
    written = await write_snapshot(store)
    assert written is not None
    objects = await store.js.object_store(snapshot_bucket_of(store.bucket))
    good = msgspec.msgpack.decode((await objects.get(OBJECT)).data, type=RecordSnapshot)
    if damage == "not a snapshot":
        blob = b"\x93\x01\x02"
    else:
        fields = msgspec.structs.asdict(good)
        if damage == "columns":
            fields["packed_seqs"] = bytes(fields["packed_seqs"])[:-8]
        else:
            fields["format"] = 2
        blob = msgspec.msgpack.encode(fields)
    await objects.put(OBJECT, blob)

    with capture_logs() as logs:
        got, mirror = await read_all(store)

    assert not mirror.from_snapshot
    assert got == await followed(store)
    assert [e["event"] for e in logs].count("store.snapshot_unused") == 1


async def test_a_snapshot_read_asks_again_while_jetstream_answers_unavailable(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a meta or stream leader changes, JetStream answers 503 to the read's consumer
    create: the restart asks again within its deadline and still reads the snapshot, instead
    of every record. Answered so for longer than the deadline, it says why and reads them."""
    store, _ = await filled(nc)
    assert await write_snapshot(store) is not None
    pull_subscribe = store.js.pull_subscribe
    refusals = [3]

    async def unavailable_at_first(*args: Any, **kwargs: Any) -> Any:
        if refusals[0] > 0:
            refusals[0] -= 1
            raise ServiceUnavailableError(
                code=503, description="JetStream system temporarily unavailable"
            )
        return await pull_subscribe(*args, **kwargs)

    monkeypatch.setattr(store.js, "pull_subscribe", unavailable_at_first)
    got, mirror = await read_all(store)
    assert refusals == [0] and mirror.from_snapshot
    assert got == await followed(store)

    refusals[0] = 10**6
    monkeypatch.setattr(snapshot, "GET_LIMIT_S", 1.0)
    info = await store.js.stream_info(store.stream)
    why = await snapshot.read_snapshot(store.js, snapshot_bucket_of(store.bucket), info, 60)
    assert isinstance(why, str) and "ServiceUnavailableError" in why, why


class Pull(NamedTuple):
    consumer: str
    answered: bool


def pulls_redirected(
    monkeypatch: pytest.MonkeyPatch, nc: Client, store: JobStore, unanswered: range
) -> list[Pull]:
    """Make the pulls of the snapshot's chunks numbered in `unanswered` (from 1) go to a
    consumer that does not exist, which NATS answers 503 (no responders), as it does while
    the stream's leader changes; the list returned gets each pull as it was meant."""
    publish = nc.publish
    pulls: list[Pull] = []
    marker = f".CONSUMER.MSG.NEXT.{objects_stream(snapshot_bucket_of(store.bucket))}."

    async def redirecting(subject: str, *args: Any, **kwargs: Any) -> None:
        if marker in subject:
            head, consumer = subject.rsplit(".", 1)
            pulls.append(Pull(consumer, len(pulls) + 1 not in unanswered))
            if not pulls[-1].answered:
                subject = f"{head}.gone"
        await publish(subject, *args, **kwargs)

    monkeypatch.setattr(nc, "publish", redirecting)
    return pulls


async def test_a_chunk_pull_answered_unavailable_is_asked_again_on_the_same_consumer(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull of the snapshot's chunks JetStream answers 503 took nothing: the read asks
    again on its consumer and goes on where it was, rather than reading from the start."""
    monkeypatch.setattr(snapshot, "CHUNKS_A_FETCH", 1)
    store, _ = await filled(nc)
    assert await write_snapshot(store) is not None
    expected = await followed(store)
    pulls = pulls_redirected(monkeypatch, nc, store, range(2, 4))
    got, mirror = await read_all(store)
    assert [p.answered for p in pulls[:4]] == [True, False, False, True]
    assert len({p.consumer for p in pulls}) == 1
    assert mirror.from_snapshot and got == expected


async def test_a_read_whose_pulls_stay_unanswered_starts_again_on_a_new_consumer(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pulls answered 503 for longer than a leader change takes (the consumer may be gone
    with its server): the read starts again on a new consumer and still uses the snapshot."""
    monkeypatch.setattr(snapshot, "CHUNKS_A_FETCH", 1)
    store, _ = await filled(nc)
    assert await write_snapshot(store) is not None
    expected = await followed(store)
    astray = range(2, 2 + snapshot.PULLS_UNANSWERED)
    pulls = pulls_redirected(monkeypatch, nc, store, astray)
    got, mirror = await read_all(store)
    first, then = pulls[0].consumer, {p.consumer for p in pulls[astray.stop - 1 :]}
    assert {p.consumer for p in pulls[: astray.stop - 1]} == {first}
    assert len(then) == 1 and first not in then
    assert mirror.from_snapshot and got == expected


async def test_the_writer_process_writes_the_snapshot_a_restart_reads(
    nc: Client, nats_url: str
) -> None:
    """The leader's writer is a process of its own, given the connection on its input."""
    store = await JobStore.open(nc.jetstream(), f"snap{uuid.uuid4().hex[:8]}")
    await store.put_many([record(f"j{i}", order=i) for i in range(300)])
    snapshots = Snapshots(
        SnapshotJob(nats=NatsOptions(url=nats_url), bucket=store.bucket),
        after_writes=100,
        gap_s=1.0,
        now=0.0,
    )
    assert not snapshots.due(store.acked_seq, now=0.5)  # too soon
    assert snapshots.due(store.acked_seq, now=1.0)

    written = await snapshots.write(now=1.0)

    assert written is not None and written.keys == 300
    assert snapshots.last_seq == written.last_seq == store.acked_seq
    assert not snapshots.due(store.acked_seq, now=10.0)  # nothing written since
    await store.delete("j3")
    got, mirror = await read_all(store)
    assert mirror.from_snapshot and set(got["records"]) == {f"j{i}" for i in range(300)} - {"j3"}


async def test_a_snapshot_its_full_store_refuses_leaves_the_last_one_to_restart_from(
    nc: Client, nats_url: str
) -> None:
    """The object store holds the old snapshot and the new one while one replaces the other:
    bounded below that, the new one is refused part-way (its chunks taken back), the failure
    is counted, and a restart reads the old snapshot and everything written after it."""
    store = await JobStore.open(nc.jetstream(), f"snap{uuid.uuid4().hex[:8]}")
    await store.put_many([record(f"j{i}", order=i) for i in range(300)])
    job = SnapshotJob(nats=NatsOptions(url=nats_url), bucket=store.bucket)
    first = await Snapshots(job, after_writes=1, gap_s=1.0, now=0.0).write(now=1.0)
    assert first is not None
    await store.js.delete_object_store(snapshot_bucket_of(store.bucket))
    bounded = msgspec.structs.replace(job, max_bytes=first.bytes + first.bytes // 2)
    snapshots = Snapshots(bounded, after_writes=1, gap_s=1.0, now=0.0)
    kept = await snapshots.write(now=1.0)  # fits alone
    assert kept is not None and snapshots.failed == 0
    await store.put_many([record(f"k{i}", order=300 + i) for i in range(100)])

    with capture_logs() as logs:
        assert await snapshots.write(now=3.0) is None
    assert snapshots.failed == 1 and snapshots.last_seq == kept.last_seq
    failed = [e for e in logs if e["event"] == "store.snapshot_failed"]
    assert failed and "maximum bytes exceeded" in str(failed[0]), failed
    info = await store.js.stream_info(objects_stream(snapshot_bucket_of(store.bucket)))
    assert info.state.bytes < kept.bytes + 4096  # the kept object alone: none of the new
    got, mirror = await read_all(store)
    assert mirror.from_snapshot and mirror.snapshot_seq == kept.last_seq
    assert got == await followed(store)
    assert len(got["records"]) == 400


async def test_a_writer_that_cannot_reach_nats_fails_and_writes_nothing(nc: Client) -> None:
    store = await JobStore.open(nc.jetstream(), f"snap{uuid.uuid4().hex[:8]}")
    await store.put(record("j1"))
    snapshots = Snapshots(
        SnapshotJob(nats=NatsOptions(url="nats://127.0.0.1:1"), bucket=store.bucket),
        after_writes=1,
        gap_s=1.0,
        now=0.0,
    )
    with capture_logs() as logs:
        assert await snapshots.write(now=1.0) is None
    assert snapshots.failed == 1 and snapshots.last_seq == 0
    assert any(e["event"] == "store.snapshot_failed" for e in logs)
    with pytest.raises(BucketNotFoundError):
        await store.js.object_store(snapshot_bucket_of(store.bucket))


def writers() -> list[int]:
    """The snapshot writer processes this test process runs."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"snapshotwriter" in cmdline:
            found.append(int(pid))
    return found


async def silent_nats() -> asyncio.Server:
    """A server on 127.0.0.1 that takes connections and never says a word."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the writer's side goes away
        writer.close()

    return await asyncio.start_server(hold, "127.0.0.1", 0)


def silent_job(server: asyncio.Server) -> SnapshotJob:
    port = server.sockets[0].getsockname()[1]
    return SnapshotJob(nats=NatsOptions(url=f"nats://127.0.0.1:{port}"), bucket="B")


async def test_a_writer_that_hangs_is_killed_at_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshotwriter, "WRITE_LIMIT_S", 1.0)
    server = await silent_nats()
    snapshots = Snapshots(silent_job(server), after_writes=1, gap_s=1.0, now=0.0)
    with capture_logs() as logs:
        assert await snapshots.write(now=1.0) is None
    server.close()
    assert snapshots.failed == 1 and not writers()
    assert any("no result" in e.get("why", "") for e in logs)


async def test_a_writer_ends_with_the_leadership_that_started_it() -> None:
    server = await silent_nats()
    snapshots = Snapshots(silent_job(server), after_writes=1, gap_s=1.0, now=0.0)
    writing = asyncio.create_task(snapshots.write(now=1.0))
    await wait_for(lambda: bool(writers()), 10, what="the writer process")
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    server.close()
    assert not writers()


async def test_a_writer_that_cannot_start_costs_nothing_but_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No process to be had: the leader's snapshot loop goes on, only the snapshot is not
    written."""
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    snapshots = Snapshots(
        SnapshotJob(nats=NatsOptions(), bucket="B"), after_writes=1, gap_s=1.0, now=0.0
    )
    with capture_logs() as logs:
        assert await snapshots.write(now=1.0) is None
    assert snapshots.failed == 1
    assert any("did not start" in e.get("why", "") for e in logs)


async def test_a_snapshot_missing_chunks_is_not_used(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "GET_LIMIT_S", 1.0)
    store, _ = await filled(nc)
    await write_snapshot(store)
    bucket = snapshot_bucket_of(store.bucket)
    info = await (await store.js.object_store(bucket)).get_info(OBJECT)
    await store.js.purge_stream(objects_stream(bucket), subject=f"$O.{bucket}.C.{info.nuid}")

    with capture_logs() as logs:
        got, mirror = await read_all(store)

    assert not mirror.from_snapshot
    assert got == await followed(store)
    assert any("did not all arrive" in e.get("why", "") for e in logs)


async def _chunk_subjects(nc: Client, bucket: str) -> set[str]:
    info = await nc.jetstream().stream_info(
        objects_stream(bucket), subjects_filter=f"$O.{bucket}.C.>"
    )
    return set(info.state.subjects or {})


async def test_chunks_a_writer_left_unnamed_are_dropped_by_a_later_write_once_idle(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer cut off mid-put leaves chunks no description names; the next write drops
    them once they sat idle for a writer's time limit. Chunks written since (a writer still
    putting) and the snapshot's own are kept, and the snapshot is read as before."""
    monkeypatch.setattr(snapshotwriter, "UNNAMED_CHUNKS_IDLE_S", 1.0)
    store = await JobStore.open(nc.jetstream(), f"orph{uuid.uuid4().hex[:8]}")
    await store.put_many([record(f"j{i}", order=i) for i in range(300)])
    first = await write_snapshot(store)
    assert first is not None and first.chunks_dropped == 0
    bucket = snapshot_bucket_of(store.bucket)
    cut_off = f"$O.{bucket}.C.cutoffwriter"
    for _ in range(3):
        await store.js.publish(cut_off, os.urandom(1024))
    await asyncio.sleep(1.1)  # the idle time itself, patched to 1 s
    await store.put_many([record(f"k{i}", order=300 + i) for i in range(10)])

    second = await write_snapshot(store)
    still_putting = f"$O.{bucket}.C.stillputting"
    await store.js.publish(still_putting, os.urandom(1024))
    third = await write_snapshot(store)

    assert second is not None and second.chunks_dropped == 1
    assert third is not None and third.chunks_dropped == 0
    objects = await store.js.object_store(bucket)
    own = f"$O.{bucket}.C.{(await objects.get_info(OBJECT)).nuid}"
    assert await _chunk_subjects(nc, bucket) == {own, still_putting}
    # Later the snapshot's own chunks are as idle as the other writer's, and a second object
    # is described too: only the unnamed ones go.
    await asyncio.sleep(1.1)
    await objects.put("newer", b"a newer description")
    assert await snapshotwriter.drop_unnamed_chunks(store.js, bucket, 1.0) == 1
    newer = f"$O.{bucket}.C.{(await objects.get_info('newer')).nuid}"
    assert await _chunk_subjects(nc, bucket) == {own, newer}
    got, mirror = await read_all(store)
    assert mirror.from_snapshot and mirror.snapshot_seq == third.last_seq
    assert len(got["records"]) == 310


async def test_a_bounded_store_full_of_unnamed_chunks_takes_the_next_snapshot(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unnamed chunks are dropped before the put: in a store bounded by max_bytes they are
    what would refuse every snapshot after them."""
    monkeypatch.setattr(snapshotwriter, "UNNAMED_CHUNKS_IDLE_S", 1.0)
    store = await JobStore.open(nc.jetstream(), f"orph{uuid.uuid4().hex[:8]}")
    await store.put_many([record(f"j{i}", order=i) for i in range(300)])
    size = await write_snapshot(store)
    assert size is not None
    bucket = snapshot_bucket_of(store.bucket)
    await store.js.delete_object_store(bucket)
    bound = size.bytes * 3
    first = await write_snapshot(store, max_bytes=bound)
    assert first is not None
    cut_off = f"$O.{bucket}.C.cutoffwriter"
    for _ in range(size.bytes // 8192 + 1):  # a whole object's worth, never described
        await store.js.publish(cut_off, os.urandom(8192))
    await asyncio.sleep(1.1)  # the idle time itself, patched to 1 s
    await store.put_many([record(f"k{i}", order=300 + i) for i in range(10)])

    second = await write_snapshot(store, max_bytes=bound)

    assert second is not None and second.chunks_dropped == 1
    got, mirror = await read_all(store)
    assert mirror.from_snapshot and mirror.snapshot_seq == second.last_seq
    assert len(got["records"]) == 310


async def test_a_snapshot_is_written_when_dropping_unnamed_chunks_fails(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(*_: object) -> int:
        raise OSError("the object store did not answer")

    monkeypatch.setattr(snapshotwriter, "drop_unnamed_chunks", refused)
    store = await JobStore.open(nc.jetstream(), f"orph{uuid.uuid4().hex[:8]}")
    await store.put_many([record(f"j{i}", order=i) for i in range(50)])
    with capture_logs() as logs:
        written = await write_snapshot(store)
    assert written is not None and written.chunks_dropped == 0
    assert any(e["event"] == "store.snapshot_chunks_not_dropped" for e in logs)
    got, mirror = await read_all(store)
    assert mirror.from_snapshot and mirror.snapshot_seq == written.last_seq
    assert len(got["records"]) == 50


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "delete", "purge", "purge_no_marker", "snapshot"]),
        st.integers(0, 8),  # few keys: each is written, deleted and purged again and again
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=OPS)
@example(ops=[("put", 0), ("put", 1), ("snapshot", 0), ("purge_no_marker", 0)])
@example(ops=[("put", 0), ("snapshot", 0), ("delete", 0), ("put", 2), ("purge", 2)])
def test_any_history_reads_the_same_from_its_snapshot(nats_url: str, ops: list[Any]) -> None:
    """Whatever was written, deleted or purged before and after any number of snapshots, a
    read from the newest snapshot takes what a standby following the bucket holds, or
    refuses the snapshot; it refuses one only when a key was purged without a marker."""

    async def check() -> None:
        conn = await nats.connect(nats_url)
        try:
            store = await JobStore.open(conn.jetstream(), f"prop{uuid.uuid4().hex[:8]}")
            purged_outright = written = False
            for op, key in ops:
                job_id = f"j{key}"
                if op == "put":
                    await store.put(record(job_id, order=key))
                elif op == "delete":
                    await store.delete(job_id)
                elif op == "purge":
                    await store.js.publish(
                        store.prefix + job_id, b"", headers={KV_OP: "PURGE", "Nats-Rollup": "sub"}
                    )
                elif op == "purge_no_marker":
                    # As `muster store-compact` does it: the purge, then a write, so that the
                    # stream's last sequence is a message a read is handed.
                    await store.js.purge_stream(store.stream, subject=store.prefix + job_id)
                    await store.probe()
                    purged_outright = True
                elif await write_snapshot(store) is not None:
                    purged_outright, written = False, True
            got, mirror = await read_all(store)
            assert got == await followed(store)
            info = await store.js.stream_info(store.stream)
            if mirror.from_snapshot:
                assert mirror.snapshot_seq <= info.state.last_seq
            else:  # refused only for a key purged outright since, or nothing to read
                assert purged_outright or not written or info.state.messages == 0
        finally:
            await conn.close()

    asyncio.run(check())


async def snapshotting_leader(h: Harness) -> tuple[BrokerConfig, NatsOptions, Broker]:
    """A leader of `h` that has a snapshot written after 60 records (or 1 s of quiet after
    any): its config, how it reaches NATS, and the broker."""
    limits = msgspec.structs.replace(
        h.config.limits, records_snapshot_after_writes=60, records_snapshot_gap_s=1.0
    )
    config = msgspec.structs.replace(h.config, limits=limits)
    options = NatsOptions(url=h.url)
    first = Broker(config, await nats.connect(h.url), holder="one", nats_options=options)
    h.broker, h.task = first, asyncio.create_task(first.run())
    await asyncio.wait_for(first.leading.wait(), 15)
    return config, options, first


async def test_a_leader_has_snapshots_written_and_its_successor_restores_from_one(
    harness: Harness,
) -> None:
    """A leader given how to reach NATS has its writer write a snapshot once enough was
    written; a broker restarted after a crash restores every job from it and what came
    after it."""
    h = harness
    config, options, first = await snapshotting_leader(h)
    ids = [(await h.submit(job(f"s{i}"))).job_id for i in range(80)]
    await wait_for(lambda: first.snapshot_stats()["snapshots_written"] >= 1, 30, what="a snapshot")
    # After the snapshot: read from the stream.
    ids += [(await h.submit(job(f"s{i}"))).job_id for i in range(80, 90)]
    await h.crash_broker()

    second = Broker(config, await nats.connect(h.url), holder="one", nats_options=options)
    h.broker, h.task = second, asyncio.create_task(second.run())
    await asyncio.wait_for(second.leading.wait(), 15)

    assert second.stats["restored_from_snapshot"] > 0
    assert second.machine is not None
    assert set(ids) <= set(second.machine.jobs)


async def test_a_standby_that_takes_over_knows_the_newest_snapshot_and_does_not_repeat_it(
    harness: Harness,
) -> None:
    """The standby mirrored the bucket from before any snapshot, so it restored from none;
    the leader's snapshot's description tells it, once it leads, how recent the newest one
    is. Its own snapshots wait for what is written after it (none here, in a long gap)."""
    h = harness
    config, options, first = await snapshotting_leader(h)
    slow = msgspec.structs.replace(config.limits, records_snapshot_gap_s=600.0)
    standby = Broker(
        msgspec.structs.replace(config, limits=slow),
        await nats.connect(h.url),
        holder="two",
        nats_options=options,
    )
    standby_task = asyncio.create_task(standby.run())
    await wait_for(lambda: standby.mirror is not None, 15, what="the standby mirroring")
    for i in range(80):
        await h.submit(job(f"s{i}"))
    await wait_for(lambda: first.snapshot_stats()["snapshots_written"] >= 1, 30, what="a snapshot")
    written = first.snapshot_stats()["snapshot_seq"]
    await h.crash_broker()

    h.broker, h.task = standby, standby_task
    await asyncio.wait_for(standby.leading.wait(), 30)
    assert standby.stats["restored_from_snapshot"] == 0
    await wait_for(
        lambda: standby.snapshot_stats()["snapshot_seq"] >= written,
        15,
        what="the new leader knowing the newest snapshot",
    )
    assert standby.snapshot_stats()["snapshots_written"] == 0


def test_a_snapshot_is_due_after_enough_writes_or_once_writes_went_quiet() -> None:
    job = SnapshotJob(nats=NatsOptions(), bucket="B")
    burst = Snapshots(job, after_writes=100, gap_s=10.0, now=0.0)
    assert not burst.due(150, now=9.9)  # the gap since the last try is not over
    assert burst.due(150, now=10.0)

    tail = Snapshots(job, after_writes=100, gap_s=10.0, now=0.0)
    assert not tail.due(60, now=12.0)  # 60 behind, written just now
    assert not tail.due(60, now=21.9)
    assert tail.due(60, now=22.0)  # and nothing written for a gap since
    tail.last_seq = 60
    assert not tail.due(60, now=100.0)  # nothing behind the snapshot

    off = Snapshots(job, after_writes=0, gap_s=10.0, now=0.0)
    assert not off.due(10**6, now=1e6)
