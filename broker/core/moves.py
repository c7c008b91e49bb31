"""Moves by choice: a deadline switch to on-demand, spot yielded to a waiting spot-only job,
and a return to spot; make-before-break.

The pure decisions are deadline.py's (when the slack ran out), spotyield.py's (who leaves
spot for a waiter, and when that pays) and spotreturn.py's (when a return pays).
`PlannedMoves` owns the jobs with a deadline still open and where the last spot-return scan
stopped. A move reserves the new placement first; the lifecycle's
preemption path then checkpoints, cancels the old attempt and dispatches the new one.
"""

from __future__ import annotations

import bisect
import itertools

from broker.core import deadline as deadlines
from broker.core import spotreturn, spotyield
from broker.core.backlog import Backlog
from broker.core.effects import Effect, Persist
from broker.core.ledger import Alloc
from broker.core.lifecycle import AttemptLifecycle
from broker.core.records import JobRecord, gang_request
from broker.core.registry import JobRegistry
from broker.core.scheduler import Scheduler
from broker.core.states import TERMINAL
from broker.core.types import GangRequest, Placement

# Queued jobs read per queue when looking for one that would take spot (spot-return scan).
QUEUE_SCAN_LIMIT = 4096


class PlannedMoves:
    def __init__(
        self,
        registry: JobRegistry,
        lifecycle: AttemptLifecycle,
        scheduler: Scheduler,
        backlog: Backlog,
    ) -> None:
        self._registry = registry
        self._jobs = registry.records
        self._lifecycle = lifecycle
        self._scheduler = scheduler
        self._backlog = backlog
        self._deadline_jobs: set[str] = set()  # not finished, with a deadline
        self._next_return_scan = 0.0
        self._return_cursor = ""  # the last job a spot-return scan tried
        self.spot_return = True  # off only to measure what it earns (load/sim/)
        self.spot_yield = True  # off only to measure what it earns (load/sim/)

    def watch(self, record: JobRecord) -> None:
        """A job submitted or restored: follow its deadline, if it has one."""
        if record.spec.deadline is not None and record.state not in TERMINAL:
            self._deadline_jobs.add(record.job_id)

    def forget(self, job_id: str) -> None:
        """An ended job leaves the registry (retention): nothing of it is followed."""
        self._deadline_jobs.discard(job_id)

    def tick(self, now: float, effects: list[Effect]) -> None:
        self._deadline_switches(now, effects)
        if now >= self._next_return_scan:
            self._next_return_scan = now + spotreturn.SCAN_EVERY_S
            if self.spot_yield:
                self._spot_yields(now, effects)
            if self.spot_return:
                self._spot_returns(now, effects)

    def _deadline_switches(self, now: float, effects: list[Effect]) -> None:
        """Jobs whose deadline slack ran out go to on-demand for good (deadline.py)."""
        for job_id in sorted(self._deadline_jobs):
            record = self._jobs[job_id]
            if record.state in TERMINAL:
                self._deadline_jobs.discard(job_id)
            elif deadlines.must_switch(record, now):
                record.deadline_on_demand = True
                # The request the backlog keeps for the job asked for spot: build it anew.
                self._backlog.forget(job_id)
                effects.append(Persist(record))
                current = record.current
                if record.state == "queued":
                    record.reason = "deadline: too little slack left for spot; on-demand only"
                    self._backlog.fresh.add(job_id)
                elif current is not None and current.capacity_type == "spot":
                    self._move(record, spotreturn.DEADLINE_MOVE, now, effects)

    def _spot_returns(self, now: float, effects: list[Effect]) -> None:
        """On-demand jobs that may use spot go back to it when that pays (spotreturn.py), and
        only those of higher priority than every queued job that could use spot."""
        waiting = self._queued_spot_priority(now)
        tries = 0
        live = sorted(self._lifecycle.live_jobs())
        # Round robin from where the last scan stopped, so that jobs whose move keeps
        # failing early in the order do not starve the rest.
        start = bisect.bisect_right(live, self._return_cursor)
        for job_id in live[start:] + live[:start]:
            if tries >= spotreturn.MAX_TRIES_PER_SCAN:
                break
            record = self._jobs[job_id]
            if waiting is not None and record.spec.priority <= waiting:
                continue
            if spotreturn.may_return(record, now):
                tries += 1
                self._return_cursor = job_id
                self._move(record, spotreturn.SPOT_RETURN, now, effects)

    def _spot_yields(self, now: float, effects: list[Effect]) -> None:
        """Running jobs that may use on-demand leave a spot pool to a queued spot-only job
        that waits for it, when that pays (spotyield.py); waiters earliest first, each mover
        for one waiter."""
        taken: set[str] = set()
        for _, waiter, gang in self._scheduler.spot_waiters.active:
            record = self._jobs.get(waiter.job_id)
            if record is None or record.state != "queued" or record.not_before > now:
                continue
            for pool in self._scheduler.spot_pools_for(waiter, gang):
                moving: list[Alloc] = []
                movable: list[Alloc] = []
                for a in self._scheduler.allocations_on(pool.key):
                    mover = self._jobs.get(a.job_id)
                    if mover is None or a.job_id in taken:
                        continue
                    current = mover.current
                    if current is None or current.attempt != a.key[1]:
                        continue
                    pre = mover.preempting
                    if pre is not None and pre.cause == spotyield.SPOT_YIELD:
                        moving.append(a)
                    elif spotyield.may_yield(mover, waiter, now):
                        movable.append(a)
                movable.sort(key=spotyield.mover_order)
                chosen = spotyield.freeing(pool, gang, moving, movable)
                if not chosen:
                    continue
                movers = [self._jobs[a.job_id] for a in chosen]
                why = (
                    f"moved to on-demand: {waiter.job_id}, a spot-only job, waits for its spot "
                    f"on {pool.cluster}/{pool.name}"
                )
                if self._yield(waiter, pool.price, movers, why, now, effects):
                    taken.update(r.job_id for r in movers)
                    break

    def _yield(
        self,
        waiter: GangRequest,
        spot_price: float,
        movers: list[JobRecord],
        why: str,
        now: float,
        effects: list[Effect],
    ) -> bool:
        """Reserve on-demand for every mover; when that pays (spotyield.worth_yielding) each
        moves make-before-break, else every reservation is released."""
        reserved: list[tuple[spotyield.Mover, Placement]] = []
        worth = True
        for record in movers:
            request = gang_request(record, now, self._registry.demands(record.job_id))
            request.capacity = "on-demand"
            current = record.current
            assert current is not None  # may_yield
            got = self._scheduler.reserve(request, now, replacing_attempt=current.attempt)
            if not isinstance(got, Placement):
                worth = False
                break
            flavor = self._scheduler.flavor_info(got.cluster, got.flavor)
            booked = (flavor.price_per_gpu_hour if flavor is not None else 0.0) * record.total_gpus
            # (`muster why`'s prices: every on-demand pool that could host it, per unit of work)
            dearest = max(
                (w.per_work for w in self._scheduler.work_prices(request, now)), default=0.0
            )
            spot_speed = self._scheduler.job_speed(request)(current.gpu_type.lower())
            mover = spotyield.Mover(
                record,
                current.price_per_gpu_hour * record.total_gpus,
                booked,
                dearest * spot_speed,
            )
            reserved.append((mover, got))
        if worth:
            worth = spotyield.worth_yielding(waiter, spot_price, [m for m, _ in reserved], now)
        if not worth:
            for mover, _ in reserved:
                self._scheduler.release(mover.record.job_id, mover.record.attempt + 1)
            return False
        for mover, got in reserved:
            record = mover.record
            replacement = self._lifecycle.attempt_for(record, got, now)
            deadline = now + spotreturn.move_grace_s(record)
            self._lifecycle.begin_preempt(
                record,
                spotyield.SPOT_YIELD,
                deadline,
                now,
                effects,
                reserve=False,
                replacement=replacement,
                detail=why,
            )
            if record.spec.capacity == "spot-then-on-demand":
                record.spot_exhausted = True
            record.spot_fallback = why
        return True

    def _queued_spot_priority(self, now: float) -> int | None:
        """The highest priority of a queued job that would take spot now, or None. Queues are
        in priority order, so each is read up to its first such job."""
        best: int | None = None
        for pending in self._backlog.pending.values():
            for job_id in itertools.islice(pending, QUEUE_SCAN_LIMIT):
                record = self._jobs.get(job_id)
                if record is None or record.not_before > now:
                    continue
                if best is not None and record.spec.priority <= best:
                    break
                if spotreturn.may_use_spot(record):
                    best = record.spec.priority
                    break
        return best

    def _move(self, record: JobRecord, cause: str, now: float, effects: list[Effect]) -> None:
        """Move a running job by choice, make-before-break: reserve the new placement, then
        the spot-notice path checkpoints, cancels the old attempt and dispatches the new one."""
        current = record.current
        if current is None or record.state != "running" or current.running_at is None:
            return
        request = gang_request(record, now, self._registry.demands(record.job_id))
        if cause == spotreturn.SPOT_RETURN:
            request.capacity = "spot"
            request.spot_exhausted = False
        got = self._scheduler.reserve(request, now, replacing_attempt=current.attempt)
        if not isinstance(got, Placement):
            return
        reclaims = self._scheduler.gang_reclaims_per_hour(got, now)
        if cause == spotreturn.SPOT_RETURN and not spotreturn.worth_returning(
            record, current, got.expected_cost_per_hour, reclaims, now
        ):
            self._scheduler.release(record.job_id, request.attempt)
            return
        replacement = self._lifecycle.attempt_for(record, got, now)
        deadline = now + spotreturn.move_grace_s(record)
        self._lifecycle.begin_preempt(
            record, cause, deadline, now, effects, reserve=False, replacement=replacement
        )
        if cause == spotreturn.SPOT_RETURN:
            record.spot_exhausted = False
            record.spot_fallback = None
