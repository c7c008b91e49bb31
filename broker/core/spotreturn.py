"""Spot-return: a job on on-demand because spot was short goes back to spot when spot returns
and the move pays for itself.

A job may return when it runs on on-demand, may use spot (`spot-then-on-demand` or `any`),
writes checkpoints (so the move loses nothing but its overhead), and has no deadline that
holds it on on-demand. The move pays when the expected saving over the time the job has left
exceeds what the move costs:

    saving = (on-demand $/h - spot's expected $/h with risk) * hours left
    cost   = on-demand $/h * restart overhead (checkpoint, start-up, restore)

Hours left: from the deadline's declared runtime when there is one; otherwise the time it has
run so far (a job that has run t tends to run about t more), and nothing before it has run
`MIN_RUN_S`, doubled for every return the job already made: a job that is reclaimed after
every return stops bouncing between the two (what it costs and earns: docs/simulation.md).

The destination's reclaim exposure is priced too: the gang expects `rate * nodes * hours left`
reclaims there (the pool's learned rate, risk.py), and each one costs another restart on the
way back, so

    cost   = on-demand $/h * restart overhead * (1 + expected reclaims)

A return whose spot attempt was reclaimed backs the job off: no return for `RECLAIMED_BACKOFF_S`
after that reclaim, doubled for each such return (at most `MAX_RECLAIMED_BACKOFF_S`).

Returns never compete with the queue: while a queued job of equal or higher priority could use
spot (it accepts spot and is not backing off), no job returns to spot (moves.py), since the
spot capacity a return takes is capacity that job is waiting for.

The move itself is the make-before-break path of a spot notice (moves.py): the spot
placement is reserved first, then the job checkpoints, and only when the checkpoint lands
(or the grace runs out) is the old attempt cancelled and the new one dispatched. There is
never a second live copy, and no spot placement means no move.
"""

from __future__ import annotations

from broker.core.deadline import SAFETY_S, slack_s, work_left_s
from broker.core.records import AttemptRecord, JobRecord, restart_overhead_s
from broker.core.states import PLANNED_MOVES, Cause

MIN_RUN_S = 600.0
RECLAIMED_BACKOFF_S = 3600.0
MAX_RECLAIMED_BACKOFF_S = 24 * 3600.0
SCAN_EVERY_S = 60.0  # how often live jobs are looked at
MAX_TRIES_PER_SCAN = 8  # spot placements tried per scan: bounds the scan's cost
SPOT_RETURN = Cause.SPOT_RETURN
DEADLINE_MOVE = Cause.DEADLINE_MOVE
SPOT_YIELD = Cause.SPOT_YIELD


def may_return(record: JobRecord, now: float) -> bool:
    current = record.current
    spec = record.spec
    if (
        current is None
        or record.state != "running"
        or record.preempting is not None
        or current.running_at is None
        or current.capacity_type != "on-demand"
        or spec.capacity not in ("spot-then-on-demand", "any")
        or spec.checkpoint is None
        or record.deadline_on_demand
    ):
        return False
    slack = slack_s(record, now)
    if slack is not None and slack - restart_overhead_s(spec) <= 2 * SAFETY_S:
        return False
    if now < backed_off_until(record):
        return False
    return hours_left(record, current, now) > 0.0


def backed_off_until(record: JobRecord) -> float:
    """When the job may return to spot again after returns that were reclaimed."""
    reclaimed = [
        after.ended_at
        for before, after in zip(record.attempts, record.attempts[1:], strict=False)
        if before.end_cause == SPOT_RETURN
        and after.capacity_type == "spot"
        and after.ended_at is not None
        and after.end_cause not in (None, "succeeded", *PLANNED_MOVES)
    ]
    if not reclaimed:
        return 0.0
    backoff = RECLAIMED_BACKOFF_S * 2.0 ** (len(reclaimed) - 1)
    return reclaimed[-1] + min(backoff, MAX_RECLAIMED_BACKOFF_S)


def may_use_spot(record: JobRecord) -> bool:
    """Whether a queued job would take spot capacity if it were offered."""
    capacity = record.spec.capacity
    if record.deadline_on_demand or capacity == "on-demand":
        return False
    return capacity != "spot-then-on-demand" or not record.spot_exhausted


def hours_left(record: JobRecord, current: AttemptRecord, now: float) -> float:
    if record.spec.deadline is not None:
        return work_left_s(record) / 3600.0
    ran = now - (current.running_at if current.running_at is not None else now)
    return ran / 3600.0 if ran >= min_run_s(record) else 0.0


def min_run_s(record: JobRecord) -> float:
    """How long the attempt must have run before the job may return to spot."""
    returns = sum(1 for a in record.attempts if a.end_cause == SPOT_RETURN)
    return MIN_RUN_S * 2.0**returns


def worth_returning(
    record: JobRecord,
    current: AttemptRecord,
    spot_cost_per_hour: float,
    gang_reclaims_per_hour: float,
    now: float,
) -> bool:
    """`spot_cost_per_hour`: the spot placement's expected $/h for the whole gang, risk
    included (Placement.expected_cost_per_hour); `gang_reclaims_per_hour`: how often some node
    of the placement is reclaimed (the pool's learned rate times its nodes)."""
    od_per_hour = current.price_per_gpu_hour * record.total_gpus
    hours = hours_left(record, current, now)
    saving = (od_per_hour - spot_cost_per_hour) * hours
    restart = od_per_hour * restart_overhead_s(record.spec) / 3600.0
    return saving > restart * (1.0 + gang_reclaims_per_hour * hours)


def move_grace_s(record: JobRecord) -> float:
    """How long a planned move waits for its checkpoint before it goes ahead anyway."""
    ck = record.spec.checkpoint
    cost = ck.cost_s if ck is not None and ck.cost_s is not None else 60.0
    return 3.0 * cost + 60.0
