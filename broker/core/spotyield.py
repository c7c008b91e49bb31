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
for spot-return). Its GPU-hours gained are valued at what the waiter pays for them on that
spot pool. Each mover pays on-demand instead of its spot price over its own time left, and a
restart each way (off spot now, back with spot-return later). Its on-demand time is priced
at the dearest on-demand pool that could host it, per unit of work: on-demand at a good price
is scarce too, and what a mover takes of the cheap on-demand pools, a later on-demand job
pays for at the dearest one (measured: docs/simulation.md). So

    waiter GPUs x spot $/GPU-h x shortest run so far
        > sum over movers of (dearest on-demand $ per unit of work x work per spot hour
                              - spot $/h) x left + 2 x booked on-demand $/h x restart overhead

A move pays for a waiter that needs several times the movers' GPUs, or where on-demand costs
about what spot does per unit of work. A job yields at most `MAX_YIELDS` times.

Spot-return (spotreturn.py) brings a mover back once no queued job of equal or higher priority
could use spot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.core.inventory import Pool
from broker.core.ledger import Alloc
from broker.core.placement import Gang, estimate_counts
from broker.core.records import JobRecord, restart_overhead_s
from broker.core.states import Cause
from broker.core.types import GangRequest

SPOT_YIELD = Cause.SPOT_YIELD
MIN_RUN_S = 600.0  # a mover's attempt has run at least this long
RESTARTS_PER_MOVE = 2.0  # off spot now, back with spot-return later
MAX_YIELDS = 1  # moves off spot for a waiter per job: it does not bounce between the two


@dataclass(frozen=True, slots=True)
class Mover:
    """A job that would leave spot, with the on-demand placement booked for it."""

    record: JobRecord
    spot_per_hour: float  # its gang's $/h on spot now
    od_per_hour: float  # its gang's $/h on the on-demand placement booked for it
    # its gang's $ on the dearest on-demand pool that could host it, for the work an hour on
    # its spot pool does
    dearest_per_spot_hour: float


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
        and sum(1 for a in record.attempts if a.end_cause == SPOT_YIELD) < MAX_YIELDS
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


def worth_yielding(
    waiter: GangRequest, spot_price: float, movers: Sequence[Mover], now: float
) -> bool:
    """Whether the waiter's GPU-hours gained, at `spot_price` per GPU-hour, beat what the
    movers pay more on on-demand plus their restarts (module docstring)."""
    ran = [_ran_h(m.record, now) for m in movers]
    value = waiter.total_gpu * spot_price * min(ran, default=0.0)
    cost = 0.0
    for m, left in zip(movers, ran, strict=True):
        overhead_h = restart_overhead_s(m.record.spec) / 3600.0
        cost += (m.dearest_per_spot_hour - m.spot_per_hour) * left
        cost += RESTARTS_PER_MOVE * m.od_per_hour * overhead_h
    return value > cost


def _ran_h(record: JobRecord, now: float) -> float:
    current = record.current
    if current is None or current.running_at is None:
        return 0.0
    return max(0.0, now - current.running_at) / 3600.0
