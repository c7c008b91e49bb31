"""Replication on a real three-server cluster: the broker creates its streams and buckets with
the configured replicas, brings existing ones to them, and notices a job bucket that lost
records it acknowledged instead of serving on from memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from broker.lease import LeaderLease
from broker.store import JobStore, StoreError, kv_stream_config, open_bucket
from load.natscluster import NatsCluster
from schemas.config import Replication
from schemas.subjects import Subjects
from tests.nats.world import cluster_world, connect, open_store
from tests.support import wait_for


def _streams(s: Subjects) -> list[str]:
    return [s.submit_stream, f"KV_{s.jobs_bucket}", f"KV_{s.leader_bucket}"]


async def test_streams_are_created_and_reconciled_to_the_configured_replicas(
    nats_cluster: NatsCluster,
) -> None:
    async with cluster_world(nats_cluster, Replication(replicas=1)) as w:
        js = w.nc.jetstream()
        await w.start_broker()
        await w.start_fleet(clusters=1)
        await w.submit_until_accepted("before")
        for stream in _streams(w.subjects):
            await nats_cluster.replicas_current(js, stream, 1)
        await w.stop_broker()

        # The same streams, now configured R3: the broker re-replicates them in place.
        w.config = msgspec.structs.replace(w.config, replication=Replication(replicas=3))
        await w.start_broker()
        for stream in _streams(w.subjects):
            await nats_cluster.replicas_current(js, stream, 3)
        await w.submit_until_accepted("after")
        states = await w.all_accepted_succeeded()
        assert {"before", "after"} <= set(states)


async def test_a_lost_job_bucket_is_noticed_and_written_back(nats_cluster: NatsCluster) -> None:
    """R1, as the broker shipped before: the job bucket's server comes back with an empty store
    (a lost volume). The cluster recreates the bucket empty; the leader must notice and write
    every record it holds back, not go on serving from memory."""
    placed = Replication(replicas=1, placement_tags=["node:n2"])
    async with cluster_world(nats_cluster, placed) as w:
        js = w.nc.jetstream()
        broker = await w.start_broker()
        await w.start_fleet(clusters=1)
        for i in range(30):
            await w.submit_until_accepted(f"j{i}")
        await w.all_accepted_succeeded()
        # Move the job bucket alone to n1 (a stream move), away from the lease and submissions.
        bucket = f"KV_{w.subjects.jobs_bucket}"
        info = await js.stream_info(bucket)
        info.config.placement = api.Placement(tags=["node:n1"])
        await js.update_stream(info.config)

        async def moved() -> bool:
            try:
                got = await js.stream_info(bucket)
            except Exception:  # the API times out now and then while the stream moves
                return False
            return bool(
                got.cluster
                and got.cluster.leader == "n1"
                and not got.cluster.replicas
                and got.state.messages >= 30
            )

        await wait_for(moved, 30, what="the job bucket on n1 alone")
        n1 = nats_cluster.server("n1")
        n1.kill9()
        n1.wipe()
        nats_cluster.start("n1")
        await nats_cluster.ready()

        async def written_back() -> bool:
            return broker.stats["store_records_lost"] >= 1

        await wait_for(written_back, 30, what="the broker noticing the lost records")
        store = JobStore(js, w.subjects.jobs_bucket)
        expected = {f"j{i}" for i in range(30)}

        async def all_there() -> bool:
            # The restarted server may settle its copy of the bucket after a first write-back;
            # the leader notices that again, so what counts is that every record comes back.
            try:
                return expected <= {r.job_id for r in await store.load_all(5)}
            except Exception:
                return False

        await wait_for(all_there, 60, what="every job record back in the bucket", interval=0.5)
        # And the broker keeps serving.
        await w.submit_until_accepted("later")
        await w.all_accepted_succeeded()


@pytest_asyncio.fixture
async def js(nats_cluster: NatsCluster) -> AsyncIterator[JetStreamContext]:
    nc = await connect(nats_cluster)
    yield nc.jetstream()
    await nc.close()


async def _leader(js: JetStreamContext, stream: str) -> str:
    async def elected() -> str | None:
        info = await js.stream_info(stream)
        return info.cluster.leader if info.cluster else None

    leader: str = await wait_for(elected, 15, what=f"a leader of {stream}")
    return leader


async def test_new_buckets_start_on_the_servers_their_placement_names(
    js: JetStreamContext,
) -> None:
    """Each R1 bucket is created on the server its tag names, not moved there at a later
    start: two job buckets and a lease bucket per server, so a bucket placed by chance
    would give itself away (one in 3**9)."""
    streams: dict[str, str] = {}
    for server in ("n0", "n1", "n2"):
        placed = Replication(replicas=1, placement_tags=[f"node:{server}"])
        for k in range(2):
            bucket = f"jobs_{server}_{k}"

            await open_store(js, bucket, placed, 60)
            streams[f"KV_{bucket}"] = server
        lease = LeaderLease(js, f"lease_{server}", "b1", 5.0, replication=placed)
        async with asyncio.timeout(30):
            await lease.acquire()  # a fresh stream may refuse the first write for a moment
        streams[f"KV_lease_{server}"] = server
    for stream, server in streams.items():
        info = await js.stream_info(stream)
        assert info.config.placement is not None
        assert info.config.placement.tags == [f"node:{server}"], stream
        assert await _leader(js, stream) == server, stream
        assert info.cluster is not None and not info.cluster.replicas, stream


async def test_a_placement_no_server_matches_is_refused_and_leaves_no_bucket(
    js: JetStreamContext,
) -> None:
    nowhere = Replication(replicas=1, placement_tags=["node:n9"])
    with pytest.raises(StoreError, match=r"cannot create bucket jobs.*node:n9.*server_tags"):
        await JobStore.open(js, "jobs", nowhere)
    with pytest.raises(NotFoundError):
        await js.stream_info("KV_jobs")


async def test_two_brokers_creating_a_bucket_at_once_both_open_it(
    js: JetStreamContext,
) -> None:
    placed = Replication(replicas=1, placement_tags=["node:n2"])
    layout = kv_stream_config("lease", placed, ttl=5.0)
    await asyncio.gather(*(open_bucket(js, layout, placed) for _ in range(2)))
    assert await _leader(js, "KV_lease") == "n2"


def _layout(info: api.StreamInfo) -> dict[str, object]:
    """A stream's config as its server reports it, less what names or places it."""
    config = info.config.as_dict()
    for key in ("name", "subjects", "placement"):
        config.pop(key, None)
    return config


@pytest.mark.parametrize("ttl", [None, 3.0, 600.0])
async def test_a_bucket_has_the_layout_nats_py_gives_a_kv_bucket(
    nc: Client, ttl: float | None
) -> None:
    """The bucket Muster creates (with its placement) is the one nats-py's create_key_value
    makes (which drops the placement): readers and writers that take it for a nats-py
    bucket are right to."""
    js = nc.jetstream()
    suffix = "none" if ttl is None else str(int(ttl))
    theirs, ours = f"nats_py_{suffix}", f"muster_{suffix}"
    await js.create_key_value(
        bucket=theirs,
        history=1,
        ttl=ttl,
        storage=api.StorageType.FILE,
        replicas=1,
        max_bytes=65536,
        max_value_size=4096,
        description="d",
    )
    one = Replication(replicas=1)
    layout = kv_stream_config(
        ours, one, ttl=ttl, max_bytes=65536, max_value_size=4096, description="d"
    )
    await open_bucket(js, layout, one)
    try:
        assert _layout(await js.stream_info(f"KV_{ours}")) == _layout(
            await js.stream_info(f"KV_{theirs}")
        )
        assert (await js.stream_info(f"KV_{ours}")).config.subjects == [f"$KV.{ours}.>"]
    finally:
        for bucket in (theirs, ours):
            await js.delete_key_value(bucket)


async def test_a_stream_of_the_buckets_name_that_is_no_bucket_is_refused_as_it_is(
    nc: Client,
) -> None:
    js = nc.jetstream()
    await js.add_stream(name="KV_taken", subjects=["elsewhere.>"])  # all messages per subject
    with pytest.raises(StoreError, match=r"KV_taken .* not a key-value bucket.*subject_prefix"):
        await JobStore.open(js, "taken")
    info = await js.stream_info("KV_taken")
    assert info.config.subjects == ["elsewhere.>"]
    assert info.config.max_msgs_per_subject == -1
