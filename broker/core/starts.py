"""Starts that can finish: how long a dispatched gang may take to run, and when to stop trying.

A fixed start timeout livelocks a job whose restore alone outlasts it: the attempt is killed
just before it would run, requeued, and killed again. So the limit is the base allowance
(`timeouts.start_s`, or the job's `start_timeout_s`) plus an image-pull allowance plus, for an
attempt that resumes from a checkpoint, the expected restore time: the job's declared
`checkpoint.restore_s`, else its checkpoint write cost `checkpoint.cost_s` (reading a
checkpoint back costs about what writing it did). Start failures in a row are capped
(`restart.max_start_failures`, like a Kubernetes Job's `backoffLimit`), and the pool that
failed a start is avoided by the job's next attempt.
"""

from __future__ import annotations

from broker.core.records import AttemptRecord, JobRecord
from schemas.config import Timeouts

# The cause that ends a job whose gang failed to start too often; `reason` starts with it.
START_FAILURES = "start-failures"


def restore_estimate_s(record: JobRecord) -> float:
    """Seconds the workload needs to read its checkpoint back before it runs."""
    ckpt = record.spec.checkpoint
    if ckpt is None:
        return 0.0
    if ckpt.restore_s is not None:
        return ckpt.restore_s
    return ckpt.cost_s or 0.0


def start_limit_s(record: JobRecord, attempt: AttemptRecord, timeouts: Timeouts) -> float:
    """How long after its dispatch the attempt's replicas may take to all run."""
    base = record.spec.start_timeout_s or timeouts.start_s
    restore = restore_estimate_s(record) if attempt.resume_from is not None else 0.0
    return base + timeouts.image_pull_s + restore


def start_failures_exhausted(record: JobRecord) -> str | None:
    """The failure reason once the job's start failures in a row pass its cap, else None."""
    cap = record.spec.restart.max_start_failures
    if cap is None or record.start_failures <= cap:
        return None
    return (
        f"{START_FAILURES}: the gang failed to start {record.start_failures} times in a row "
        f"(restart.max_start_failures={cap}); check the image, the node selectors and the "
        "pools' capacity, or raise start_timeout_s if the start-up is just slow"
    )
