"""Spot yielded to a queued spot-only job: running jobs that may use on-demand move off it.

A spot-only job has no other capacity. When it waits for a spot pool (spotwait.py) whose room is
held by running jobs that could run on on-demand (`any`, `spot-then-on-demand`), those jobs
move to on-demand, make-before-break, as a deadline switch does: the on-demand placement is
reserved first, the job checkpoints, and only then is its spot attempt cancelled and the
on-demand one dispatched from that checkpoint (moves.py). The waiter then takes the spot in the
next cycle, and no flexible job takes it first (placement.spot_kept_for).

Who moves (`may_yield`): a running spot attempt of a job that may run on on-demand, writes
checkpoints (the move loses only its overhead), has no deadline (deadline.py steers those), is
not moving already and has run at least `MIN_RUN_S`. It yields only to a waiter of equal or
higher priority, on a pool the waiter accepts, does not avoid and could fit, and only as many
jobs as free the room for the waiter's whole gang (`freeing`): lowest priority first, then the
latest submitted (the queue would have placed it last).

When it pays (`worth_yielding`): the waiter starts now rather than when the movers end, taken
as the shortest time any of them has run (a job that has run t tends to run about t more, as
for spot-return); its GPUs gain that time. The movers pay a restart each, and another when
spot-return brings them back, so the move is made when

    waiter GPUs x shortest run so far > 2 x sum(mover GPUs x restart overhead)

Spot-return (spotreturn.py) brings a mover back once no queued job of equal or higher priority
could use spot.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.core.inventory import Pool
from broker.core.ledger import Alloc
from broker.core.placement import Gang, estimate_counts
from broker.core.records import JobRecord, restart_overhead_s
from broker.core.states import Cause
from broker.core.types import GangRequest

SPOT_YIELD = Cause.SPOT_YIELD
MIN_RUN_S = 600.0  # a mover's attempt has run at least this long
RESTARTS_PER_MOVE = 2.0  # off spot now, back with spot-return later


def may_yield(record: JobRecord, waiter: GangRequest, now: float) -> bool:
    current = record.current
    spec = record.spec
    return (
        current is not None
        and record.state == "running"
        and record.preempting is None
        and current.running_at is not None
        and now - current.running_at >= MIN_RUN_S
        and current.capacity_type == "spot"
        and spec.capacity in ("any", "spot-then-on-demand")
        and spec.checkpoint is not None
        and spec.deadline is None
        and not record.deadline_on_demand
        and spec.priority <= waiter.priority
        and record.job_id != waiter.job_id
    )


def mover_order(a: Alloc) -> tuple[int, int]:
    """Who moves first: lowest priority, then the latest submitted."""
    return (a.priority, -a.order)


def freeing(
    pool: Pool, gang: Gang, moving: Sequence[Alloc], movable: Sequence[Alloc]
) -> list[Alloc] | None:
    """The fewest of `movable` (in the order given) whose GPUs, with those of `moving` (jobs
    already on their way off the pool), let `gang` fit the pool's ready nodes. None when the
    gang fits without a new mover (nothing to do) or not even with all of them. GPUs only, as
    the packing estimate does; the cycle that places the waiter checks the rest."""
    free = {n.name: n.free_gpu for n in pool.nodes.values() if n.schedulable}
    if not free:
        return None

    def add(a: Alloc) -> bool:
        hit = False
        for node, vec in a.per_node.items():
            if node in free:
                free[node] += vec[0]
                hit = True
        return hit

    for a in moving:
        add(a)
    if _fits(free, gang):
        return None
    chosen: list[Alloc] = []
    for a in movable:
        if not add(a):
            continue
        chosen.append(a)
        if _fits(free, gang):
            return chosen
    return None


def _fits(free: dict[str, int], gang: Gang) -> bool:
    counts = [0] * (max(free.values()) + 1)
    for g in free.values():
        counts[g] += 1
    return estimate_counts(counts, gang) is not None


def worth_yielding(waiter: GangRequest, movers: Sequence[JobRecord], now: float) -> bool:
    """Whether the waiter's GPU-time gained beats the movers' restarts (module docstring)."""
    ran = min(
        (now - r.current.running_at for r in movers if r.current and r.current.running_at),
        default=0.0,
    )
    cost = sum(r.total_gpus * restart_overhead_s(r.spec) for r in movers)
    return waiter.total_gpu * ran > RESTARTS_PER_MOVE * cost
