"""`muster store-compact`: a job bucket filled by ended jobs' records is freed, full or not;
records of unfinished jobs are left as they are."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from typer.testing import CliRunner

from broker.attempts import AttemptMarkers
from broker.core.records import JobRecord
from broker.store import JobStore, StoreError, compact_bucket
from muster.cli import app
from schemas.job import JobSpec, PodSet, Workload
from schemas.subjects import Subjects

NOW = 1_800_000_000.0


def record(job_id: str, state: str = "succeeded", finished_at: float = NOW) -> JobRecord:
    env = {f"K{i}": "v" * 1000 for i in range(60)}  # about 60 KB
    spec = JobSpec(
        name="big", gang=[PodSet(name="w", gpu=8)], workload=Workload(image="t:1", env=env)
    )
    ended = state in ("succeeded", "failed", "cancelled")
    return JobRecord(
        job_id=job_id,
        spec=spec,
        queue="q",
        order=1,
        submitted_at=NOW - 100,
        state=state,  # type: ignore[arg-type]
        finished_at=finished_at if ended else None,
    )


async def full_bucket(nc: Client, bucket: str, ended_at: float = NOW) -> tuple[JobStore, list[str]]:
    """A 1 MiB bucket filled with ended jobs' records (each a day older than the last)."""
    js = nc.jetstream()
    store = await JobStore.open(js, bucket, max_bytes=1024 * 1024)
    await store.put(record("live", state="running"))
    written = []
    for i in range(40):
        try:
            await store.put(record(f"done-{i}", finished_at=ended_at - i * 86_400))
        except StoreError:
            break
        written.append(f"done-{i}")
    else:
        raise AssertionError("the bucket never filled")
    return store, written


async def test_compacting_frees_a_full_bucket_and_keeps_unfinished_jobs(nc: Client) -> None:
    bucket = f"compact{uuid.uuid4().hex[:8]}"
    store, written = await full_bucket(nc, bucket)
    js = nc.jetstream()
    markers = AttemptMarkers(js, bucket)
    await markers.clear(7)  # the delete marker a cleared attempt marker leaves
    report = await compact_bucket(js, bucket, expire_before=None)
    with pytest.raises(NotFoundError):  # purged
        await js.get_last_msg(store.stream, markers.prefix + "7")
    assert report.compacted == len(written) and report.expired == 0
    assert report.bytes_after < report.bytes_before / 4
    await store.put(record("after", state="queued"))  # room again
    records = {r.job_id: r for r in await store.load_all()}
    assert set(written) | {"live", "after"} == set(records)
    assert records["live"].spec.workload.env  # an unfinished job keeps its workload
    for job_id in written:
        assert records[job_id].spec.workload == Workload()
        assert records[job_id].state == "succeeded"  # status and idempotency stay


async def test_the_command_expires_old_ended_jobs(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    bucket = Subjects(prefix=prefix).jobs_bucket
    store, written = await full_bucket(nc, bucket, ended_at=time.time() - 2 * 86_400)
    path = tmp_path / "broker.yaml"
    path.write_text(f"subject_prefix: {prefix}\nqueues: [{{name: q}}]\n")
    result = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["store-compact", "--nats", nats_url, "--config", str(path), "--expire-ended-days", "1"],
    )
    assert result.exit_code == 0, result.output
    assert f"deleted {len(written)}" in result.output
    remaining = {r.job_id for r in await store.load_all()}
    assert remaining == {"live"}
