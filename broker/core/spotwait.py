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

from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence

from broker.core.placement import Gang
from broker.core.records import JobRecord
from broker.core.types import GangRequest, Reason


def note_spot_held(record: JobRecord, why: str | None) -> None:
    """Record why a job's new attempt left spot to a spot-only job (`muster why` shows it),
    or that it did not (None: an older reason is stale). A spot-then-on-demand job falls back
    to on-demand as after a futile wait (spot-return may bring it back later)."""
    if record.spec.capacity == "spot-then-on-demand" and why is not None:
        record.spot_exhausted = True
        record.spot_fallback = why
    elif record.spec.capacity == "any":
        record.spot_fallback = why


def order_key(r: GangRequest) -> tuple[int, int]:
    """Queue order: higher priority first, then submitted first."""
    return (-r.priority, r.order)


class SpotWaiters:
    __slots__ = ("_active_ids", "_gang_of", "_ids", "active")

    def __init__(self, gang_of: Callable[[GangRequest], Gang]) -> None:
        self._gang_of = gang_of
        self._ids: dict[str, None] = {}  # every waiter, those backing off included
        # The waiters the last cycle looked at, with their gangs, earliest first; kept between
        # cycles for reservations and moves. Changed only here: `_active_ids` follows it, and
        # a place is found by bisection, so neither a lookup nor an insertion walks it (a walk
        # per admitted job was 68 % of a 100,000-job cycle, `load.bench_core`).
        self.active: list[tuple[GangRequest, Gang]] = []
        self._active_ids: set[str] = set()

    @property
    def ids(self) -> Sequence[str]:
        return list(self._ids)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._ids

    def begin(self, requests: Iterable[GangRequest]) -> None:
        """A cycle starts with these waiters (the machine's current requests for them)."""
        self.active = sorted(
            ((r, self._gang_of(r)) for r in requests), key=lambda w: order_key(w[0])
        )
        self._active_ids = {r.job_id for r, _ in self.active}

    def waits(self, req: GangRequest) -> None:
        """A cycle could not place spot-only `req` for capacity: it waits from now on."""
        self._ids[req.job_id] = None
        if req.job_id in self._active_ids:
            return
        # after the waiters of the same key
        at = bisect_right(self.active, order_key(req), key=lambda w: order_key(w[0]))
        self.active.insert(at, (req, self._gang_of(req)))
        self._active_ids.add(req.job_id)

    def forget(self, job_id: str) -> None:
        """The job was placed, left the queue or waits for something other than capacity."""
        self._ids.pop(job_id, None)
        if job_id in self._active_ids:
            self._drop({job_id})

    def _drop(self, gone: set[str]) -> None:
        """Take these waiters out of `active`, in one pass."""
        self._active_ids -= gone
        self.active = [w for w in self.active if w[0].job_id not in gone]

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
            reasons = pending.get(r.job_id)
            if r.capacity != "spot" or reasons is None:
                continue
            if any(x.code == "insufficient-capacity" for x in reasons):
                self._ids[r.job_id] = None
            else:
                self._ids.pop(r.job_id, None)
                gone.add(r.job_id)
        gone &= self._active_ids
        if gone:
            self._drop(gone)
