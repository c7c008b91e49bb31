"""The queued spot-only jobs that wait for spot capacity: one list, kept by the scheduler.

A spot-only job has no other capacity to go to, so spot it waits for is kept for it. A job is a
waiter from the admission cycle that failed to place it for capacity (`insufficient-capacity`)
until a cycle admits it or fails it for another reason; the machine drops it when it leaves the
queue, and passes only those not backing off into each cycle (`Machine._waiting_for_spot`).
Three rules read the list, earliest first (higher priority, then submitted first):

- a job that may run on on-demand does not take that spot in a cycle
  (placement.spot_kept_for);
- nor in the make-before-break reservation at a spot notice (Scheduler.reserve);
- a running one moves off it, make-before-break, when that pays (spotyield.py, moves.py).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter

from broker.core.inventory import Pool
from broker.core.placement import Gang, OrderKey, Waiter, spot_kept_for
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


_by_key = itemgetter(0)  # a Waiter's order key, read in C by bisect


class SpotWaiters:
    __slots__ = ("_gang_of", "_groups", "_ids", "_where", "active")

    def __init__(self, gang_of: Callable[[GangRequest], Gang]) -> None:
        self._gang_of = gang_of
        self._ids: dict[str, None] = {}  # every waiter, those backing off included
        # The waiters the last cycle looked at, with their gangs, earliest first; kept between
        # cycles for reservations and moves. Changed only here. `_where` gives each one's
        # order key and group, so a place is found by bisection and neither a lookup, an
        # insertion nor a removal walks the list (a walk per admitted job was 68 % of a
        # 100,000-job cycle, `load.bench_core`).
        self.active: list[Waiter] = []
        self._where: dict[str, tuple[OrderKey, Group]] = {}
        # The same waiters by the pools they accept (GPU types, avoided pools, gang), each
        # group earliest first: whether a pool's spot is kept asks each group's head only
        # (placement.spot_kept_for); walking every earlier waiter was a fifth of that cycle.
        self._groups: dict[Group, list[Waiter]] = {}

    @property
    def ids(self) -> Sequence[str]:
        return list(self._ids)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._ids

    def kept_for(self, req: GangRequest, pool: Pool, running: bool = False) -> GangRequest | None:
        """The waiter `pool`'s spot is kept for against `req` (placement.spot_kept_for)."""
        return spot_kept_for(req, pool, self._groups.values(), running)

    def begin(self, requests: Iterable[GangRequest]) -> None:
        """A cycle starts with these waiters (the machine's current requests for them)."""
        self._index(
            sorted((Waiter(order_key(r), r, self._gang_of(r)) for r in requests), key=_by_key)
        )

    def _index(self, active: list[Waiter]) -> None:
        self.active = active
        self._where = {}
        self._groups = {}
        for w in active:
            group = _group(w)
            self._where[w.request.job_id] = (w.key, group)
            self._groups.setdefault(group, []).append(w)

    def waits(self, req: GangRequest) -> None:
        """A cycle could not place spot-only `req` for capacity: it waits from now on."""
        self._ids[req.job_id] = None
        if req.job_id in self._where:
            return
        w = Waiter(order_key(req), req, self._gang_of(req))
        group = _group(w)
        self._where[req.job_id] = (w.key, group)
        _file(self.active, w)
        _file(self._groups.setdefault(group, []), w)

    def forget(self, job_id: str) -> None:
        """The job was placed, left the queue or waits for something other than capacity."""
        self._ids.pop(job_id, None)
        if job_id in self._where:
            self._unlist(job_id)

    def _unlist(self, job_id: str) -> None:
        key, group = self._where.pop(job_id)
        _remove(self.active, job_id, key)
        members = self._groups[group]
        _remove(members, job_id, key)
        if not members:
            del self._groups[group]

    def _drop(self, gone: set[str]) -> None:
        """Take these waiters out, in one pass."""
        self._index([w for w in self.active if w.request.job_id not in gone])

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
        gone = {job_id for job_id in gone if job_id in self._where}
        if len(gone) > 1:
            self._drop(gone)
        elif gone:
            self._unlist(gone.pop())


def _group(w: Waiter) -> Group:
    """Waiters of one group accept the same pools (placement.spot_kept_for)."""
    return (w.request.gpu_types, w.request.avoid_pools, w.gang.demands)


def _file(waiters: list[Waiter], w: Waiter) -> None:
    """Put `w` after the waiters of its key or earlier ones. A cycle takes jobs in queue
    order, so its new waiters mostly come last: that place is tried first."""
    if not waiters or waiters[-1].key <= w.key:
        waiters.append(w)
    else:
        waiters.insert(bisect_right(waiters, w.key, key=_by_key), w)


def _remove(waiters: list[Waiter], job_id: str, key: OrderKey) -> None:
    at = bisect_left(waiters, key, key=_by_key)
    while waiters[at].request.job_id != job_id:  # past the other waiters of the same key
        at += 1
    del waiters[at]
