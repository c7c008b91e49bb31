"""The leader's watch over the job bucket: a bucket recreated empty under it (an R1 server
that lost its store) is noticed and every record in memory is written back, and a write-back
the recreated bucket refuses is tried again until it lands."""

from __future__ import annotations

import uuid

from nats.aio.client import Client

from broker.core.records import JobRecord
from broker.store import BucketWatch, JobStore
from schemas.job import JobSpec, PodSet, Workload

NOW = 1_800_000_000.0


def record(job_id: str) -> JobRecord:
    env = {f"K{i}": "v" * 1000 for i in range(60)}  # about 60 KB
    spec = JobSpec(
        name="big", gang=[PodSet(name="w", gpu=8)], workload=Workload(image="t:1", env=env)
    )
    return JobRecord(
        job_id=job_id, spec=spec, queue="q", order=1, submitted_at=NOW, state="running"
    )


async def test_a_write_back_the_recreated_bucket_refuses_is_tried_again(nc: Client) -> None:
    js = nc.jetstream()
    bucket = f"watch{uuid.uuid4().hex[:8]}"
    store = await JobStore.open(js, bucket, max_bytes=1024 * 1024)
    held = [record(f"j{i}") for i in range(3)]
    await store.put_many(held)
    watch = BucketWatch(store, lambda: held)
    assert not await watch.check()  # nothing lost

    # The bucket comes back empty, and with room for one record only.
    await js.delete_key_value(bucket)
    await JobStore.open(js, bucket, max_bytes=100_000)
    try:
        await watch.check()
    except Exception:
        pass
    else:
        raise AssertionError("a write-back into a bucket too small for it succeeded")
    assert watch.losses == 1 and watch.owed

    # The bucket gets its room back: the next check writes every record back.
    info = await js.stream_info(store.stream)
    info.config.max_bytes = 1024 * 1024
    await js.update_stream(info.config)
    assert await watch.check()
    assert {r.job_id for r in await store.load_all(5)} == {"j0", "j1", "j2"}
    assert (watch.losses, watch.owed, watch.repersisted) == (1, False, 3)
    assert not await watch.check()
