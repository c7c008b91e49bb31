"""Job specs and stored records the broker's tests submit and seed, shared across folders."""

from __future__ import annotations

from typing import Any

from broker.core.records import JobRecord
from schemas.api import JobState
from schemas.codec import decode_jobspec, encode_json


def job(name: str, replicas: int = 2, gpu: int = 4, **extra: Any) -> dict[str, Any]:
    return {"name": name, "gang": [{"name": "worker", "replicas": replicas, "gpu": gpu}], **extra}


def stored_record(i: int, state: JobState = "queued") -> JobRecord:
    """Job `j<i>` as the store holds it: one 8-GPU replica on the default queue."""
    spec = decode_jobspec(encode_json(job("x", replicas=1, gpu=8)))
    return JobRecord(
        job_id=f"j{i}", spec=spec, queue="default", order=i, submitted_at=1.0, state=state
    )
