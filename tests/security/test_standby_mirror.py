"""A hot standby under the generated authorization: its mirror of the job bucket (an ordered
push consumer, so JetStream flow control asks it to answer on `$JS.FC.…`) reads every record
with the broker's own credentials and draws no permission error; so do the job bucket's
snapshot writer and a restart's read of the snapshot."""

from __future__ import annotations

from broker.snapshotwriter import SnapshotJob, Snapshots
from broker.store import JobStore, RecordMirror
from schemas.subjects import Subjects
from tests.broker.jobs import stored_record
from tests.security.conftest import CONFIG, AuthNats, options_as

RECORDS = 20_000  # ~20 MB: far past the point where the server asks for flow control


async def test_the_standby_mirror_reads_the_whole_bucket_within_its_permissions(
    auth_nats: AuthNats,
) -> None:
    writer = await auth_nats.connect("broker")
    reader = await auth_nats.connect("broker")
    bucket = Subjects(prefix=CONFIG.subject_prefix).jobs_bucket
    store = await JobStore.open(writer.jetstream(), bucket, nc=writer)
    for start in range(0, RECORDS, 2_000):
        await store.put_many([stored_record(i) for i in range(start, start + 2_000)])
    mirror = RecordMirror(JobStore(reader.jetstream(), bucket, reader))
    try:
        records = await mirror.caught_up(60)
    finally:
        await mirror.stop()
    assert len(records) == RECORDS
    assert auth_nats.errors.get("broker", []) == []


async def test_the_snapshot_writer_and_a_restart_read_within_the_brokers_permissions(
    auth_nats: AuthNats,
) -> None:
    """The snapshot's writer process connects as the broker and writes its object store; a
    restart's read takes the snapshot with the same credentials."""
    nc = await auth_nats.connect("broker")
    bucket = Subjects(prefix=CONFIG.subject_prefix).jobs_bucket
    store = await JobStore.open(nc.jetstream(), bucket, nc=nc)
    await store.put_many([stored_record(i) for i in range(500)])
    snapshots = Snapshots(
        SnapshotJob(nats=options_as(auth_nats, "broker"), bucket=bucket),
        after_writes=1,
        gap_s=1.0,
        now=0.0,
    )
    written = await snapshots.write(now=1.0)
    assert written is not None and written.keys == 500
    mirror = RecordMirror(JobStore(nc.jetstream(), bucket, nc))
    try:
        records = await mirror.caught_up(60)
    finally:
        await mirror.stop()
    assert mirror.from_snapshot and len(records) == 500
    assert auth_nats.errors.get("broker", []) == []
