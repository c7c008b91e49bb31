"""Job specs and stored records the broker's tests submit and seed, shared across folders."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.core.records import JobRecord
from schemas.api import JobState
from schemas.codec import decode_jobspec, encode_json
from tests.support import wait_for

if TYPE_CHECKING:
    from broker.service import Broker


def job(name: str, replicas: int = 2, gpu: int = 4, **extra: Any) -> dict[str, Any]:
    return {"name": name, "gang": [{"name": "worker", "replicas": replicas, "gpu": gpu}], **extra}


def stored_record(i: int, state: JobState = "queued") -> JobRecord:
    """Job `j<i>` as the store holds it: one 8-GPU replica on the default queue."""
    spec = decode_jobspec(encode_json(job("x", replicas=1, gpu=8)))
    return JobRecord(
        job_id=f"j{i}", spec=spec, queue="default", order=i, submitted_at=1.0, state=state
    )


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
