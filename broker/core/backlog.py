"""Queue indexing: which queued jobs an admission cycle looks at, and when.

Holds the pending queues, the jobs new since the last cycle, the backoff and spot-fallback
timers, each job's cached `GangRequest`, and the queued jobs a cycle left waiting for spot
(earlier.py). It reads job records and never changes them,
except for the spot fallback flag when a job has waited on spot long enough.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping

from broker.core.earlier import EarlierWaiters, shape_of
from broker.core.pending import PendingQueue
from broker.core.placement import wants_spot
from broker.core.records import JobRecord, gang_request
from broker.core.types import GangRequest, PodSetDemand, Reason
from schemas.config import QueueConfig


class Backlog:
    def __init__(
        self, queues: Mapping[str, QueueConfig], inventory_version: Callable[[], int] = int
    ) -> None:
        self.queues = queues
        # Capacity changed since the last cycle when the inventory's version moved (nodes,
        # pools, schedulability) or a cause the inventory does not see set `capacity_dirty`.
        self._inventory_version = inventory_version
        self._seen_version = inventory_version()
        self.pending: dict[str, PendingQueue] = {q: PendingQueue() for q in queues}
        self.fresh: set[str] = set()  # queued since the last cycle: looked at whatever else
        self.capacity_dirty = True  # capacity freed elsewhere: every queue's heads again
        self.lookahead = 256  # parked jobs per queue reconsidered when capacity frees
        self._backoff: list[tuple[float, str]] = []
        self._spot_waiting: set[str] = set()  # queued spot-then-on-demand jobs still on spot
        self._spot_due: list[tuple[float, str]] = []  # (fallback time, job_id), lazily checked
        # job_id -> ((attempt, spot_exhausted, avoid count), valid until, request)
        self._requests: dict[str, tuple[tuple[int, bool, int], float, GangRequest]] = {}
        self._truncated = False  # the last cycle left parked jobs beyond the lookahead
        self._truncated_queues: set[str] = set()
        self._recycle: set[str] = set()  # queues to look at again (see `admitted`)
        self.earlier_waiters = EarlierWaiters()  # tried, unplaced, wanting spot (earlier.py)

    @property
    def capacity_changed(self) -> bool:
        return self.capacity_dirty or self._inventory_version() != self._seen_version

    def capacity_seen(self) -> None:
        """A cycle looked at every change so far (the ones it made itself included)."""
        self.capacity_dirty = False
        self._seen_version = self._inventory_version()

    def cycle_done(self) -> None:
        """The changes a cycle made itself (a probe blocking its pool) give no new chance."""
        self._seen_version = self._inventory_version()

    @property
    def wants_cycle(self) -> bool:
        return bool(self.fresh) or self.capacity_changed or bool(self._recycle)

    def __len__(self) -> int:
        return sum(len(p) for p in self.pending.values())

    def enqueue(self, record: JobRecord) -> None:
        self.pending.setdefault(record.queue, PendingQueue()).add(
            record.job_id, record.spec.priority, record.order
        )
        self.fresh.add(record.job_id)
        self._waits(record)

    def enqueue_many(self, records: Iterable[JobRecord]) -> None:
        """Enqueue restored jobs, not fresh (each was tried before the restart, or is as good
        as a parked one); each queue sorted once."""
        by_queue: dict[str, list[tuple[str, int, int]]] = {}
        for record in records:
            by_queue.setdefault(record.queue, []).append(
                (record.job_id, record.spec.priority, record.order)
            )
            self._waits(record)
        for queue, items in by_queue.items():
            self.pending.setdefault(queue, PendingQueue()).add_many(items)

    def _waits(self, record: JobRecord) -> None:
        """Note what a queued job waits for besides capacity: its backoff, spot's fallback."""
        if record.not_before > record.queued_at:
            heapq.heappush(self._backoff, (record.not_before, record.job_id))
        if waits_for_spot(record):
            self._spot_waiting.add(record.job_id)
            due = record.queued_at + record.spec.spot.fallback_after_wait_s
            heapq.heappush(self._spot_due, (due, record.job_id))

    def dequeue(self, record: JobRecord) -> None:
        pending = self.pending.get(record.queue)
        if pending is not None:
            pending.discard(record.job_id)
        self.fresh.discard(record.job_id)
        self._spot_waiting.discard(record.job_id)
        self.earlier_waiters.drop(record.job_id)

    def forget(self, job_id: str) -> None:
        self._requests.pop(job_id, None)

    def due(self, jobs: Mapping[str, JobRecord], now: float) -> None:
        """Jobs whose backoff ended, and spot jobs that waited long enough to fall back to
        on-demand, become fresh."""
        while self._backoff and self._backoff[0][0] <= now:
            _, job_id = heapq.heappop(self._backoff)
            waiting = jobs.get(job_id)
            if waiting is not None and waiting.state == "queued":
                self.fresh.add(job_id)
        while self._spot_due and self._spot_due[0][0] < now:
            due, job_id = heapq.heappop(self._spot_due)
            record = jobs[job_id]
            if job_id not in self._spot_waiting:
                continue
            if record.state != "queued" or not waits_for_spot(record):
                self._spot_waiting.discard(job_id)
            elif now - record.queued_at > record.spec.spot.fallback_after_wait_s:
                record.spot_exhausted = True
                self._spot_waiting.discard(job_id)
                self.fresh.add(job_id)
            else:  # requeued since: wait from the newer queued_at
                again = record.queued_at + record.spec.spot.fallback_after_wait_s
                heapq.heappush(self._spot_due, (max(again, due), job_id))

    def candidates(
        self,
        jobs: Mapping[str, JobRecord],
        demands: Mapping[str, tuple[PodSetDemand, ...]],
        now: float,
    ) -> list[GangRequest]:
        """The requests of the jobs that could have become admissible since the last cycle:
        the fresh ones, and the heads of every queue whose chances changed."""
        touched: set[str] = set(self.queues) if self.capacity_changed else set()
        touched |= self._recycle
        self._recycle = set()
        fresh_ok: list[str] = []
        for job_id in self.fresh:
            record = jobs.get(job_id)
            if record is None or record.state != "queued":
                continue
            if record.not_before > now:
                continue
            qconf = self.queues.get(record.queue)
            if qconf is None or qconf.strategy == "StrictFIFO":
                # A strict queue's head may block the new job. In a best-effort queue the
                # parked heads failed with at least the capacity left now (any increase
                # marks capacity dirty), so a cycle for new jobs needs only the new jobs.
                touched.add(record.queue)
            fresh_ok.append(job_id)
        self.fresh.clear()
        self.capacity_seen()
        chosen: dict[str, None] = {}
        self._truncated = False
        self._truncated_queues.clear()

        def ready(job_id: str) -> bool:
            return jobs[job_id].not_before <= now

        for queue in touched:
            pending = self.pending.get(queue)
            if not pending:
                continue
            if len(pending) > self.lookahead:
                self._truncated = True
                self._truncated_queues.add(queue)
            for job_id in pending.heads(self.lookahead, ready):
                chosen[job_id] = None
        for job_id in fresh_ok:
            chosen[job_id] = None
        return [self.request(jobs[job_id], now, demands[job_id]) for job_id in chosen]

    def admitted(self, queues: set[str]) -> None:
        """A cycle admitted jobs of these queues. Parked jobs beyond the lookahead wait behind
        the heads just admitted: keep cycling while cycles make progress, or a deep backlog
        would wait for the next capacity change. Only the queues that admitted get new
        heads; the others' heads failed with at least as much capacity as is left now."""
        if self._truncated:
            self._recycle |= queues & self._truncated_queues

    def wake(self, queues: set[str]) -> None:
        """Consider these queues' heads in the next cycle: something they wait for is due."""
        self._recycle |= queues

    def earlier_spot_waiters(
        self,
        jobs: Mapping[str, JobRecord],
        demands: Mapping[str, tuple[PodSetDemand, ...]],
        reasons: Mapping[str, tuple[Reason, ...]],
        now: float,
        tried: Mapping[str, GangRequest],
    ) -> list[GangRequest]:
        """Requests of the queues' heads (the first `lookahead` jobs of each queue) that an
        earlier cycle left waiting for spot and that are not backing off, besides `tried`
        (this cycle's own, whose requests count as they were tried). Of each queue and gang
        shape only the earliest: any later one comes after it for the same spot (earlier.py).
        Waiters found no longer queued or no longer wanting spot are dropped."""
        out: list[GangRequest] = []
        gone: list[str] = []
        moved: list[GangRequest] = []
        for queue, shapes in self.earlier_waiters.queues():
            pending = self.pending.get(queue)
            bound = pending.nth_key(self.lookahead) if pending is not None else None
            for shape, filed in shapes.items():
                for key in filed.entries():
                    if bound is not None and key >= bound:
                        break  # beyond the heads, as is every later one of this queue
                    job_id = key[2]
                    mine = tried.get(job_id)
                    if mine is not None:
                        if wants_spot(mine) and shape_of(mine) == shape:
                            break  # its own request is the earliest of this shape
                        continue
                    record = jobs.get(job_id)
                    if record is None or record.state != "queued" or job_id not in reasons:
                        gone.append(job_id)
                        continue
                    if record.not_before > now:
                        continue  # backing off: not waiting for capacity now
                    request = self.request(record, now, demands[job_id])
                    if not wants_spot(request):
                        gone.append(job_id)
                        continue
                    out.append(request)
                    if shape_of(request) == shape:
                        break
                    moved.append(request)  # its gang changed: filed anew, looked at here
        for job_id in gone:
            self.earlier_waiters.drop(job_id)
        for request in moved:
            self.earlier_waiters.file(request)
        return out

    def request(
        self, record: JobRecord, now: float, demands: tuple[PodSetDemand, ...]
    ) -> GangRequest:
        """The job's GangRequest, rebuilt only when what it is made of changed: a parked job
        is reconsidered in many cycles, and building its request dominated their cost."""
        stamp = (record.attempt, record.spot_exhausted, len(record.avoid))
        hit = self._requests.get(record.job_id)
        if hit is not None and hit[0] == stamp and now < hit[1]:
            return hit[2]
        request = gang_request(record, now, demands)
        until = min((a.until for a in record.avoid if a.until > now), default=math.inf)
        self._requests[record.job_id] = (stamp, until, request)
        return request


def waits_for_spot(record: JobRecord) -> bool:
    """A spot-then-on-demand job that may still fall back to on-demand after waiting: not one
    that already did, nor one its deadline put on on-demand for good."""
    return (
        record.spec.capacity == "spot-then-on-demand"
        and not record.spot_exhausted
        and not record.deadline_on_demand
    )
