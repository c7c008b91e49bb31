"""Job specs and stored records the broker's tests submit and seed, shared across folders."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.core.records import JobRecord, record_encoder
from schemas.api import JobState
from schemas.codec import decode_jobspec, encode_json
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
        "bytes": dict(mirror.usage.bytes),
        "active": dict(mirror.usage.active),
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
