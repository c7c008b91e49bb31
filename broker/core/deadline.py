"""Deadlines, Can't-Be-Late style: use spot while the slack allows, then on-demand for good.

    slack = deadline - now - work left - restart overhead

Work left is `runtime_s` times the share of `total_steps` the newest checkpoint has not
reached: only checkpointed progress survives a reclaim, so it is the progress to count. The
restart overhead (records.restart_overhead_s) is one more move. While a job waits for spot
or runs on it, its slack shrinks; once it is down to `SAFETY_S` (the time the broker needs to
notice and act), the job is switched: a queued job asks for on-demand only, a job on spot
moves to on-demand make-before-break (moves.py), and it never returns to spot.
"""

from __future__ import annotations

from broker.core.records import JobRecord, restart_overhead_s

SAFETY_S = 120.0


def deadline_at(record: JobRecord) -> float | None:
    d = record.spec.deadline
    return None if d is None else record.submitted_at + d.within_s


def work_left_s(record: JobRecord) -> float:
    d = record.spec.deadline
    if d is None:
        return 0.0
    ckpt = record.latest_checkpoint
    done = min(1.0, ckpt.step / d.total_steps) if ckpt is not None else 0.0
    return d.runtime_s * (1.0 - done)


def slack_s(record: JobRecord, now: float) -> float | None:
    """Seconds the job can still spend not making progress; None without a deadline."""
    at = deadline_at(record)
    if at is None:
        return None
    return at - now - work_left_s(record) - restart_overhead_s(record.spec)


def must_switch(record: JobRecord, now: float) -> bool:
    """True when the job should be on on-demand from now on to finish in time."""
    if record.deadline_on_demand or record.spec.capacity == "on-demand":
        return False
    slack = slack_s(record, now)
    return slack is not None and slack <= SAFETY_S
