"""GPU-seconds, lost work and cost of attempts: the one place that knows how they are counted."""

from __future__ import annotations

from broker.core.records import AttemptRecord, JobRecord
from schemas.api import Accounting, AttemptView


def work_since(record: JobRecord, attempt: AttemptRecord) -> float:
    """When the work a loss of `attempt` now would throw away began: its newest checkpoint,
    else the time the gang ran, else its dispatch. The ledger's victim ranking
    (`Scheduler.note_progress`) and the lost GPU-seconds of an ended attempt both read this."""
    since = attempt.running_at if attempt.running_at is not None else attempt.dispatched_at
    ckpt = record.latest_checkpoint
    if ckpt is not None and ckpt.attempt == attempt.attempt:
        since = max(since, ckpt.at)
    return since


def attempt_gpus(record: JobRecord, attempt: AttemptRecord) -> int:
    """The GPUs the attempt holds: the whole gang's, or for an elastic job (whose size
    changes while it runs) those of the replicas it runs now."""
    spec = record.spec
    if not any(p.elastic for p in spec.gang):
        return record.total_gpus
    per = {p.name: p.gpu for p in spec.gang}
    return sum(len(a.nodes) * per.get(a.podset, 0) for a in attempt.assignment)


def used_gpu_seconds(attempt: AttemptRecord, gpus: int, now: float) -> float:
    """GPU-seconds from dispatch to `now`, an elastic attempt's sizes each for its time."""
    since = attempt.resized_at if attempt.resized_at is not None else attempt.dispatched_at
    return attempt.gpu_seconds_before + max(0.0, now - since) * gpus


def note_resize(record: JobRecord, attempt: AttemptRecord, now: float) -> None:
    """Before an elastic attempt changes size: bank what it used at the old one."""
    attempt.gpu_seconds_before = used_gpu_seconds(attempt, attempt_gpus(record, attempt), now)
    attempt.resized_at = now


def close_attempt(
    record: JobRecord, attempt: AttemptRecord, cause: str, now: float, *, lost: bool
) -> None:
    """Stamp the attempt's end and what it used, lost and cost."""
    attempt.ended_at = now
    attempt.end_cause = cause
    gpus = attempt_gpus(record, attempt)
    attempt.gpu_seconds = used_gpu_seconds(attempt, gpus, now)
    if lost:
        if attempt.running_at is not None:
            attempt.gpu_seconds_lost = max(0.0, now - work_since(record, attempt)) * gpus
            # Start-up time before the gang ran is lost too.
            attempt.gpu_seconds_lost += (attempt.running_at - attempt.dispatched_at) * gpus
        else:
            attempt.gpu_seconds_lost = attempt.gpu_seconds
    attempt.cost = attempt.gpu_seconds / 3600.0 * attempt.price_per_gpu_hour


def backoff_delay(record: JobRecord, failures: int) -> float:
    policy = record.spec.restart
    return float(min(policy.backoff_s * 2 ** max(0, failures - 1), policy.max_backoff_s))


def attempt_view(attempt: AttemptRecord, gpus: int, now: float) -> AttemptView:
    gpu_seconds = attempt.gpu_seconds
    cost = attempt.cost
    if attempt.ended_at is None:
        gpu_seconds = used_gpu_seconds(attempt, gpus, now)
        cost = gpu_seconds / 3600.0 * attempt.price_per_gpu_hour
    return AttemptView(
        attempt=attempt.attempt,
        cluster=attempt.cluster,
        flavor=attempt.flavor,
        capacity_type=attempt.capacity_type,
        gpu_type=attempt.gpu_type,
        dispatched_at=attempt.dispatched_at,
        running_at=attempt.running_at,
        ended_at=attempt.ended_at,
        end_cause=attempt.end_cause,
        resume_from_step=attempt.resume_from.step if attempt.resume_from else None,
        gpu_seconds=gpu_seconds,
        gpu_seconds_lost=attempt.gpu_seconds_lost,
        cost=cost,
    )


def accounting(record: JobRecord, attempts: list[AttemptView]) -> Accounting:
    used = sum(a.gpu_seconds for a in attempts)
    lost = sum(a.gpu_seconds_lost for a in attempts)
    return Accounting(
        attempts=len(record.attempts),
        preemptions=record.preemptions,
        errors=record.errors,
        gpu_seconds_used=used,
        gpu_seconds_lost=lost,
        goodput=(used - lost) / used if used > 0 else 1.0,
        cost=sum(a.cost for a in attempts),
    )


def accounting_of(record: JobRecord, now: float) -> Accounting:
    return accounting(
        record, [attempt_view(a, attempt_gpus(record, a), now) for a in record.attempts]
    )
