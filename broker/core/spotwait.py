"""The queued spot-only jobs that wait for spot capacity: one owner, the scheduler.

A spot-only job has no other capacity to go to, so spot it waits for is kept for it. A job is a
waiter from the admission cycle that failed to place it for capacity (`insufficient-capacity`)
until a cycle admits it or fails it for another reason; the machine drops it when it leaves the
queue, and passes only those not backing off into each cycle (`Machine._waiting_for_spot`).
Three rules read them, earliest first (higher priority, then submitted first):

- a job that may run on on-demand does not take that spot in a cycle
  (placement.spot_kept_for);
- nor in the make-before-break reservation at a spot notice (Scheduler.reserve);
- a running one moves off it, make-before-break, when that pays (spotyield.py, moves.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from heapq import heapify, heappop, heappush
from itertools import count
from operator import itemgetter

from broker.core.inventory import Pool
from broker.core.placement import Gang, OrderKey, Waiter, may_yield_spot, spot_kept_for
from broker.core.records import JobRecord
from broker.core.types import GangRequest, PodSetDemand, PoolKey, Reason


def note_spot_held(record: JobRecord, why: str | None) -> None:
    """Record why a job's new attempt left spot to a spot-only job (`muster why` shows it),
    or that it did not (None: an older reason is stale). A spot-then-on-demand job falls back
    to on-demand as after a futile wait (spot-return may bring it back later)."""
    if record.spec.capacity == "spot-then-on-demand" and why is not None:
        record.spot_exhausted = True
        record.spot_fallback = why
    elif record.spec.capacity == "any":
        record.spot_fallback = why


Group = tuple[frozenset[str], frozenset[PoolKey], tuple[PodSetDemand, ...]]


def order_key(r: GangRequest) -> OrderKey:
    """Queue order: higher priority first, then submitted first."""
    return (-r.priority, r.order)


_by_key = itemgetter(0)  # a Waiter's order key


class SpotWaiters:
    COMPACT_SLACK = 1024  # dead heap entries beyond the live ones that trigger a rebuild

    __slots__ = ("_entries", "_gang_of", "_groups", "_heads", "_ids", "_seq", "_sorted", "_where")

    def __init__(self, gang_of: Callable[[GangRequest], Gang]) -> None:
        self._gang_of = gang_of
        self._ids: dict[str, None] = {}  # every waiter, those backing off included
        # The waiters the last cycle looked at, kept between cycles for reservations and
        # moves; changed only here. Each has an entry in its group's heap, numbered by `_seq`.
        self._where: dict[str, tuple[Waiter, Group, int]] = {}
        # The same waiters by the pools they accept (GPU types, avoided pools, gang), in a heap
        # each, earliest first: whether a pool's spot is kept asks each group's head only
        # (placement.spot_kept_for). A heap files a waiter without moving the others (a sorted
        # list's insertion moved half of it: quadratic in a 100,000-job cycle). An entry whose
        # waiter left stays until it comes to the top, where it is dropped: every head is live.
        # `_entries` counts them all, live or not: past twice the live, the heaps are rebuilt.
        self._groups: dict[Group, list[tuple[OrderKey, int, Waiter]]] = {}
        self._entries = 0
        self._seq = count()
        self._heads: list[Waiter] | None = None  # the groups' heads, until one changes
        self._sorted: list[Waiter] | None = None  # `active`, until a waiter comes or goes

    @property
    def ids(self) -> Sequence[str]:
        return list(self._ids)

    @property
    def heaps(self) -> Sequence[Sequence[tuple[OrderKey, int, Waiter]]]:
        """Each group's heap as filed, entries of waiters that left included (a view for
        checks)."""
        return [tuple(heap) for heap in self._groups.values()]

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._ids

    @property
    def any_active(self) -> bool:
        return bool(self._where)

    @property
    def active(self) -> Sequence[Waiter]:
        """The waiters the last cycle looked at, earliest first (ties: the first filed)."""
        if self._sorted is None:
            self._sorted = sorted((w for w, _, _ in self._where.values()), key=_by_key)
        return self._sorted

    def kept_for(self, req: GangRequest, pool: Pool, running: bool = False) -> GangRequest | None:
        """The waiter `pool`'s spot is kept for against `req` (placement.spot_kept_for)."""
        if not may_yield_spot(req, pool):
            return None  # before the heads besides a waiter's own, which walk every entry
        heads = self._heads
        if heads is None:
            heads = self._heads = [heap[0][2] for heap in self._groups.values()]
        if req.job_id in self._where:  # it heads its group, or might: judge the next instead
            heads = [self._head_besides(group, req.job_id) for group in self._groups]
        return spot_kept_for(req, pool, heads, running)

    def _head_besides(self, group: Group, job_id: str) -> Waiter:
        live = [e for e in self._groups[group] if self._live(e) and e[2].request.job_id != job_id]
        return min(live)[2] if live else self._groups[group][0][2]

    def _live(self, entry: tuple[OrderKey, int, Waiter]) -> bool:
        where = self._where.get(entry[2].request.job_id)
        return where is not None and where[2] == entry[1]

    def begin(self, requests: Sequence[GangRequest]) -> None:
        """A cycle starts with these waiters (the machine's current requests for them, one per
        job). One filed for the very request it is given stays filed: a parked job's request
        is rebuilt only when it changed (`Backlog.request`), so a cycle files the new and the
        changed waiters, not all of them again: a flood's cycle over 60,000 queued jobs took
        104-116 ms filing them all anew, 29 ms now (`python -m load.bench_flood_cycle --depth
        60000`; docs/benchmarks.md, "Spot waiters kept filed between cycles")."""
        where = self._where
        fresh: list[GangRequest] = []
        kept = 0
        for r in requests:
            filed = where.get(r.job_id)
            if filed is not None:
                if filed[0].request is r:
                    kept += 1
                    continue
                self._unlist(r.job_id)
            fresh.append(r)
        if len(where) > kept:  # some filed waiter is not among them: it left, or backs off
            given = {r.job_id for r in requests}
            for job_id in [j for j in where if j not in given]:
                self._unlist(job_id)
        # In queue order, so that new waiters of equal keys are filed in it.
        fresh.sort(key=order_key)
        for r in fresh:
            self._add(Waiter(order_key(r), r, self._gang_of(r)))

    def _add(self, w: Waiter) -> None:
        group, seq = _group(w), next(self._seq)
        self._where[w.request.job_id] = (w, group, seq)
        entries = self._groups.setdefault(group, [])
        heappush(entries, (w.key, seq, w))
        self._entries += 1
        if entries[0][1] == seq:  # a new head (of a new group, or before the old one)
            self._heads = None
        self._sorted = None

    def waits(self, req: GangRequest) -> None:
        """A cycle could not place spot-only `req` for capacity: it waits from now on."""
        self._ids[req.job_id] = None
        if req.job_id not in self._where:
            self._add(Waiter(order_key(req), req, self._gang_of(req)))

    def forget(self, job_id: str) -> None:
        """The job was placed, left the queue or waits for something other than capacity."""
        self._ids.pop(job_id, None)
        if job_id in self._where:
            self._unlist(job_id)

    def _unlist(self, job_id: str) -> None:
        _, group, seq = self._where.pop(job_id)
        self._sorted = None
        heap = self._groups[group]
        if heap[0][1] != seq:
            # Not the head: dropped when it comes to the top, or when the heaps hold twice
            # the live waiters (kept between cycles, a heap whose head stays would keep every
            # later waiter that left).
            if self._entries > 2 * len(self._where) + self.COMPACT_SLACK:
                self._compact()
            return
        self._heads = None
        while heap and not self._live(heap[0]):
            heappop(heap)
            self._entries -= 1
        if not heap:
            del self._groups[group]

    def _compact(self) -> None:
        """Each group's heap rebuilt of its live entries."""
        groups: dict[Group, list[tuple[OrderKey, int, Waiter]]] = {}
        for w, group, seq in self._where.values():
            groups.setdefault(group, []).append((w.key, seq, w))
        for entries in groups.values():
            heapify(entries)
        self._groups = groups
        self._entries = len(self._where)
        self._heads = None

    def settle(
        self,
        tried: Sequence[GangRequest],
        pending: Mapping[str, tuple[Reason, ...]],
        admitted: Iterable[str],
    ) -> None:
        """After a cycle: its spot-only jobs left for capacity wait, the others do not."""
        gone: set[str] = set()
        for job_id in admitted:
            self._ids.pop(job_id, None)
            gone.add(job_id)
        for r in tried:
            if r.capacity != "spot":
                continue
            reasons = pending.get(r.job_id)
            if reasons is None:
                continue
            if any(x.code == "insufficient-capacity" for x in reasons):
                self._ids[r.job_id] = None
            else:
                self._ids.pop(r.job_id, None)
                gone.add(r.job_id)
        for job_id in gone:
            if job_id in self._where:
                self._unlist(job_id)


def _group(w: Waiter) -> Group:
    """Waiters of one group accept the same pools (placement.spot_kept_for)."""
    return (w.request.gpu_types, w.request.avoid_pools, w.gang.demands)
