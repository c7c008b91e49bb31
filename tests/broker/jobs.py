"""Job specs and stored records the broker's tests submit and seed, shared across folders."""

from __future__ import annotations

import random
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.client import Client

from broker.core.records import RECORD_FORMAT, JobRecord, record_encoder
from broker.store import KV_OP, JobStore
from schemas.api import JobState
from schemas.codec import decode_jobspec, encode_json
from schemas.job import JobSpec, PodSet
from tests.support import wait_for

if TYPE_CHECKING:
    from broker.service import Broker
    from broker.store import RecordMirror


def job(name: str, replicas: int = 2, gpu: int = 4, **extra: Any) -> dict[str, Any]:
    return {"name": name, "gang": [{"name": "worker", "replicas": replicas, "gpu": gpu}], **extra}


def stored_record(i: int, state: JobState = "queued") -> JobRecord:
    """Job `j<i>` as the store holds it: one 8-GPU replica on the default queue."""
    spec = decode_jobspec(encode_json(job("x", replicas=1, gpu=8)))
    return JobRecord(
        job_id=f"j{i}", spec=spec, queue="default", order=i, submitted_at=1.0, state=state
    )


def mirror_took(mirror: RecordMirror, records: list[JobRecord]) -> dict[str, Any]:
    """What a mirror's `caught_up` gave and kept: the records (encoded, to compare), the
    newest sequence applied, the records of a newer format and the usage figures."""
    return {
        "records": {r.job_id: record_encoder.encode(r) for r in records},
        "applied": mirror.applied,
        "too_new": dict(mirror.too_new),
        # A queue whose last record was dropped counts 0, one never seen is absent: alike.
        "bytes": {q: n for q, n in mirror.usage.bytes.items() if n},
        "active": {q: n for q, n in mirror.usage.active.items() if n},
    }


async def processed_with_headers_refused(broker: Broker, job_ids: list[str]) -> None:
    """Wait until every one of these submissions is a job and each one's reply header was
    refused (`refused["reply_header"]` counts them all)."""
    machine = broker.machine
    assert machine is not None
    await wait_for(
        lambda: all(j in machine.jobs for j in job_ids), 10, what="every submission processed"
    )
    await wait_for(
        lambda: broker.refused["reply_header"] == len(job_ids), 10, what="every header refused"
    )


KEYS = 12_000  # more than 10,000: a key per job of a large bucket (`filled`)


def record(job_id: str, state: str = "queued", order: int = 0) -> JobRecord:
    spec = JobSpec(name="r", gang=[PodSet(name="w", gpu=8)])
    return JobRecord(
        job_id=job_id,
        spec=spec,
        queue=f"q{order % 7}",
        order=order,
        submitted_at=1.0,
        state=state,  # type: ignore[arg-type]
    )


async def filled(nc: Client) -> tuple[JobStore, dict[str, str]]:
    """A bucket of KEYS jobs, some updated, deleted, purged, corrupt or of a newer format;
    returns the store and what each changed job became."""
    rng = random.Random(34)
    store = await JobStore.open(nc.jetstream(), f"read{uuid.uuid4().hex[:8]}")
    records = [record(f"j{i}", order=i) for i in range(KEYS)]
    for at in range(0, KEYS, 1000):
        await store.put_many(records[at : at + 1000])
    fate: dict[str, str] = {}
    for i in rng.sample(range(KEYS), 400):
        job_id, kind = f"j{i}", rng.choice(CHANGES)
        fate[job_id] = kind
        await change(store, job_id, i, kind)
    await store.probe()  # a key that is not a job's, written last
    return store, fate


CHANGES = ["updated", "deleted", "purged", "corrupt", "newer"]


async def change(store: JobStore, job_id: str, order: int, kind: str) -> None:
    """Write one of CHANGES to job `job_id`'s key: a newer state, a delete or a purge marker,
    bytes that are no record, or a record of a newer format."""
    js, subject = store.js, store.prefix + job_id
    if kind == "updated":
        await store.put(record(job_id, state="running", order=order))
    elif kind == "deleted":
        await store.delete(job_id)
    elif kind == "purged":
        await js.publish(subject, b"", headers={KV_OP: "PURGE", "Nats-Rollup": "sub"})
    elif kind == "corrupt":
        await js.publish(subject, b"\x93\x01\x02")
    else:
        fields = msgspec.msgpack.decode(record_encoder.encode(record(job_id, order=order)))
        fields.update(format=RECORD_FORMAT + 1, placement_v2={"zones": ["a"]})
        await js.publish(subject, msgspec.msgpack.encode(fields))
