"""The one-time batched read of the job bucket (`broker.bucketread`) on a real three-server
cluster with an R3 bucket: it rides over what the ordered consumer of a standby's mirror rides
over (no stream or consumer leader yet, a leader election during the read) and ends with
exactly what that mirror holds, never with part of it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import NoStreamResponseError
from nats.js.object_store import OBJ_DEFAULT_CHUNK_SIZE

from broker import bucketread, snapshot
from broker.snapshot import objects_stream, read_snapshot
from broker.snapshotwriter import SnapshotWritten, write_snapshot
from broker.store import JobStore, RecordMirror, StreamUnanswered
from load.natscluster import NatsCluster
from schemas.config import Replication
from schemas.subjects import snapshot_bucket_of
from tests.broker.jobs import mirror_took, stored_record
from tests.nats.world import connect, open_store
from tests.support import wait_for

R3 = 3
# How long the stream stays without a leader: past nats-py's 5 s default for one API call.
LEADERLESS_S = 6.0


async def leave_one_follower(nats_cluster: NatsCluster, js: JetStreamContext, stream: str) -> str:
    """Kill every server but one follower of `stream`, and return that follower's URL. (A
    leader that lost its followers goes on answering for the stream, naming itself, until it
    sees it lost its quorum: `lostQuorumInterval` after, checked every 10 s, nats-server
    server/raft.go.)"""
    leader = await nats_cluster.stream_leader(js, stream)
    survivor = next(s for s in nats_cluster.servers if s.name != leader)
    for server in nats_cluster.servers:
        if server is not survivor:
            server.kill9()
    return survivor.url


async def filled_store(nc: Client, jobs: int, replicas: int | Replication = R3) -> JobStore:
    """A new bucket of `replicas` holding `jobs` records, some of them written twice. The
    first write is asked again while the new stream's subjects have no responders yet."""
    bucket = f"read{uuid.uuid4().hex[:8]}"
    store = await open_store(nc.jetstream(), bucket, replicas, 30)

    async def first_written() -> bool:
        try:
            await store.put(stored_record(0))
        except StreamUnanswered:
            return False
        return True

    await wait_for(first_written, 30, what=f"stream of {store.bucket} answering")
    for at in range(0, jobs, 500):
        await store.put_many([stored_record(i) for i in range(at, min(at + 500, jobs))])
    await store.put_many([stored_record(i, state="running") for i in range(0, jobs, 7)])
    return store


async def r3_snapshot_written(store: JobStore) -> SnapshotWritten:
    """The bucket's snapshot in a new R3 object store, written again when that store's stream
    answered no write (its servers electing a leader anew just after it was made, which a
    loaded machine makes more likely); a broker's next snapshot is that retry."""

    async def written() -> SnapshotWritten | None:
        try:
            return await write_snapshot(store, replication=Replication(replicas=R3))
        except NoStreamResponseError:
            return None

    return await wait_for(written, 30, what="the snapshot written")


async def step_down(nats_cluster: NatsCluster, nc: Client, stream: str) -> str:
    """Ask the stream's leader to step down until another one leads (it refuses while no
    follower is current): the new leader's name."""
    js = nc.jetstream()
    old = await nats_cluster.stream_leader(js, stream)

    async def moved() -> str | None:
        with contextlib.suppress(Exception):
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader not in (None, old):
                return info.cluster.leader
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=2)
        return None

    return await wait_for(moved, 30, what=f"{stream} led by another", interval=0.2)


async def by_ordered_mirror(store: JobStore) -> dict[str, Any]:
    live = RecordMirror(store)
    await live.start()
    try:
        return mirror_took(live, await live.caught_up(60))
    finally:
        await live.stop()


async def read_across_the_outage(nats_cluster: NatsCluster, once: RecordMirror) -> dict[str, Any]:
    """What `once` holds after a restart read begun while servers are down: it must still be
    asking after LEADERLESS_S, when the servers are started again."""
    read = asyncio.create_task(once.caught_up(60))
    finished, _ = await asyncio.wait({read}, timeout=LEADERLESS_S)
    assert not finished, read.exception() if read.done() else None  # still asking
    for server in nats_cluster.servers:
        if not server.running:
            server.start(nats_cluster.servers)
    return mirror_took(once, await read)


async def test_a_bucket_just_created_is_read_whole(nats_cluster: NatsCluster) -> None:
    """Read the moment it is written, as a broker that leads at once reads the bucket it has
    just created: the stream's and the consumer's leaders, and the consumer's interest across
    the routes, may not be there yet (the pull answered 503)."""
    nc = await connect(nats_cluster)
    try:
        for jobs in [1, 3, 1, 50] * 4:
            store = await filled_store(nc, jobs)
            once = RecordMirror(store)  # never started: one batched read
            by_read = mirror_took(once, await once.caught_up(30))
            assert len(by_read["records"]) == jobs
            assert by_read == await by_ordered_mirror(store)
            assert not await store.js.consumers_info(store.stream)
    finally:
        await nc.close()


async def test_a_read_across_a_stream_leader_change_is_whole(
    nats_cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's leader steps down three times during the read, each time before one of
    its pull requests goes out, and the second time the read's consumer is dropped with it
    (its pull requests end, "409 Consumer Deleted" or a 503): a new one reads on from the
    sequence after the last one taken, and the read is whole."""
    monkeypatch.setattr(bucketread, "BATCH", 100)
    nc = await connect(nats_cluster)
    try:
        store = await filled_store(nc, 3000)
        js = store.js
        await nats_cluster.replicas_current(js, store.stream, R3)
        publish = nc.publish
        pulls: list[str] = []

        async def stepped_down(drop: str | None) -> bool:
            """The stream led by another; then the read's consumer `drop` dropped, as a
            server that lost it would."""
            await step_down(nats_cluster, nc, store.stream)
            return drop is None or await js.delete_consumer(store.stream, drop)

        # Kept apart from the read's pull requests, which a read that starts again cancels.
        stepping: list[asyncio.Task[bool]] = []

        async def stepping_down_publish(subject: str, *args: Any, **kwargs: Any) -> None:
            if ".CONSUMER.MSG.NEXT." in subject:
                pulls.append(subject)
                if len(pulls) in (3, 7, 11):
                    drop = subject.split(".")[-1] if len(pulls) == 7 else None
                    stepping.append(asyncio.create_task(stepped_down(drop)))
                if stepping:
                    await asyncio.shield(stepping[-1])
            await publish(subject, *args, **kwargs)

        monkeypatch.setattr(nc, "publish", stepping_down_publish)
        once = RecordMirror(store)
        by_read = mirror_took(once, await once.caught_up(60))
        monkeypatch.setattr(nc, "publish", publish)

        assert [await task for task in stepping] == [True] * 3
        assert len({p.split(".")[-1] for p in pulls}) >= 2, "the dropped consumer replaced"
        assert len(by_read["records"]) == 3000
        await nats_cluster.replicas_current(js, store.stream, R3)
        assert by_read == await by_ordered_mirror(store)
    finally:
        await nc.close()


async def test_a_read_of_a_stream_that_keeps_no_leader_stops_at_its_deadline(
    nats_cluster: NatsCluster,
) -> None:
    """Two of the three servers die: the R3 stream has no quorum, so no leader, for as long as
    they stay down. The read asks again until its deadline, then says it did not catch up and
    names the stream to check; it never returns a partial read as whole."""
    nc = await connect(nats_cluster)
    try:
        store = await filled_store(nc, 50)
        survivor = await leave_one_follower(nats_cluster, store.js, store.stream)
    finally:
        await nc.close()
    nc = await nats.connect(survivor, max_reconnect_attempts=0)
    try:
        taken: list[int] = []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(bucketread.ReadStopped, match=f"did not catch up .*{store.stream}"):
            await bucketread.read_newest(
                nc.jetstream(),
                store.stream,
                store.prefix + ">",
                lambda _msg, seq: taken.append(seq),
                done,
                expires_s=3.0,
            )
        assert not done.done()  # nothing claimed the read complete
        # A restart's first question, the stream's last sequence, gives up alike.
        with pytest.raises(bucketread.ReadStopped, match=f"{store.stream} did not answer"):
            await bucketread.leader_state(nc.jetstream(), store.stream, 3.0)

        # Once the group has been leaderless for nats-server's lostQuorumInterval (10 s), the
        # follower answers STREAM.INFO itself, naming no leader: its own state, not the
        # stream's, so the last sequence is still not known.
        async def answers_leaderless() -> bool:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    info = await nc.jetstream().stream_info(store.stream)
                return info.cluster is not None and not info.cluster.leader
            return False

        await wait_for(answers_leaderless, 30, what="the follower answering with no leader")
        with pytest.raises(bucketread.ReadStopped, match=f"{store.stream} did not answer"):
            await bucketread.leader_state(nc.jetstream(), store.stream, 3.0)
    finally:
        await nc.close()


async def test_a_restart_read_that_begins_with_no_stream_leader_waits_for_one(
    nats_cluster: NatsCluster,
) -> None:
    """A broker restarting while its bucket's stream has no leader (two of three servers
    down, so no quorum) keeps asking within its deadline instead of failing the leadership at
    once, and once the servers are back it holds every record."""
    nc = await connect(nats_cluster)
    try:
        store = await filled_store(nc, 50)
        expected = await by_ordered_mirror(store)
        await leave_one_follower(nats_cluster, store.js, store.stream)
        once = RecordMirror(store)  # never started: a restarted broker's one batched read
        assert await read_across_the_outage(nats_cluster, once) == expected
    finally:
        await nc.close()


async def test_a_restart_read_while_the_cluster_has_no_meta_leader_waits_for_one(
    nats_cluster: NatsCluster,
) -> None:
    """An R1 bucket's server answers for its stream alone, but whether the bucket's snapshot
    store exists only the meta leader answers, and with two of three servers down there is
    none: the read asks again within its deadline, not failing at the first unanswered
    question, and once the servers are back it holds every record. Given less time than the
    outage, the snapshot's reader gives up and says why."""
    nc = await connect(nats_cluster)
    try:
        # A bucket on a server that is not the meta leader: a meta leader left alone goes on
        # answering (as a stream's leader does) until it sees it lost its quorum.
        meta = await nats_cluster.meta_leader()
        holder = next(s.name for s in nats_cluster.servers if s.name != meta)
        placed = Replication(replicas=1, placement_tags=[f"node:{holder}"])
        store = await filled_store(nc, 50, placed)
        assert await nats_cluster.stream_leader(store.js, store.stream) == holder
        expected = await by_ordered_mirror(store)
        for server in nats_cluster.servers:
            if server.name != holder:
                server.kill9()
        # Asked for less time than the outage lasts, the snapshot's reader gives up and says
        # why (the restart then reads every record).
        info = await bucketread.leader_state(store.js, store.stream, 30)  # on the survivor
        why = await read_snapshot(store.js, snapshot_bucket_of(store.bucket), info, 1.0)
        assert isinstance(why, str) and "did not answer" in why, why
        once = RecordMirror(store)
        assert await read_across_the_outage(nats_cluster, once) == expected
        assert not once.from_snapshot
    finally:
        await nc.close()


async def test_a_restart_read_across_the_snapshot_stores_leader_change_is_whole(
    nats_cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot's object store (R3) changes leader between two of the restart's pulls of
    its chunks: the read's consumer goes on, so the restart still reads from the
    snapshot, and it ends with exactly what a standby's mirror holds."""
    monkeypatch.setattr(snapshot, "CHUNKS_A_FETCH", 1)
    nc = await connect(nats_cluster)
    try:
        store = await filled_store(nc, 3000)
        js = store.js
        written = await r3_snapshot_written(store)
        assert written.bytes > 3 * OBJ_DEFAULT_CHUNK_SIZE
        objects = objects_stream(snapshot_bucket_of(store.bucket))
        await nats_cluster.replicas_current(js, objects, R3)
        await store.put_many([stored_record(i, state="succeeded") for i in range(0, 3000, 11)])
        expected = await by_ordered_mirror(store)
        publish = nc.publish
        pulls: list[str] = []
        moved: list[str] = []

        async def stepping_down_publish(subject: str, *args: Any, **kwargs: Any) -> None:
            if f".CONSUMER.MSG.NEXT.{objects}." in subject:
                pulls.append(subject)
                if len(pulls) == 2:
                    moved.append(await step_down(nats_cluster, nc, objects))
            await publish(subject, *args, **kwargs)

        monkeypatch.setattr(nc, "publish", stepping_down_publish)
        once = RecordMirror(store)
        got = mirror_took(once, await once.caught_up(60))
        monkeypatch.setattr(nc, "publish", publish)

        assert moved and len({p.split(".")[-1] for p in pulls}) == 1  # one consumer, on
        # A pull a chunk, and one again for each the leader change answered 503.
        chunks = -(-written.bytes // OBJ_DEFAULT_CHUNK_SIZE)
        assert chunks <= len(pulls) < chunks + snapshot.PULLS_UNANSWERED
        assert once.from_snapshot and got == expected
    finally:
        await nc.close()
