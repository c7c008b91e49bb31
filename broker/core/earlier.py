"""The queued jobs a cycle left waiting for spot, filed by queue and gang shape, kept from one
admission cycle to the next.

A spot-then-on-demand job stops waiting for spot when an earlier queued job that wants spot,
no bigger and accepting every GPU type it does, already waits for it
(placement.futile_spot_waits). Finding those earlier waiters by walking every queue's heads
each cycle took ~30 % of the broker during a submission flood (100 queues x 256 heads per
cycle). They are filed here instead: a job when a cycle leaves it unplaced with a request
that wants spot, dropped when it leaves the queue. Of one shape (GPU types, total GPUs) in one
queue only the earliest still waiting matters: a later one asks for the same spot and comes
after it, so `futile_spot_waits` names the same earlier job without it. A cycle therefore
reads one job per queue and shape (`Backlog.spot_waiters_ahead`), and a job whose request
stopped wanting spot since it was filed (a fallback, a deadline switch) is dropped there.
"""

from __future__ import annotations

from collections.abc import Iterator

from broker.core.pending import PendingQueue
from broker.core.placement import wants_spot
from broker.core.types import GangRequest

Shape = tuple[frozenset[str], int]  # (GPU types, total GPUs): what a waiter competes for


def shape_of(request: GangRequest) -> Shape:
    return (request.gpu_types, request.total_gpu)


class EarlierWaiters:
    __slots__ = ("_filed", "_places", "_where")

    def __init__(self) -> None:
        self._where: dict[str, tuple[str, Shape]] = {}  # job id -> (queue, shape)
        self._filed: dict[str, dict[Shape, PendingQueue]] = {}  # queue -> shape -> jobs
        # One copy of each (queue, shape): 100,000 filed jobs share a few hundred.
        self._places: dict[tuple[str, Shape], tuple[str, Shape]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._where

    def file(self, request: GangRequest) -> None:
        """A cycle left the job of `request` unplaced: it waits, for spot when it wants it."""
        job_id = request.job_id
        if not wants_spot(request):
            self.drop(job_id)
            return
        at = (request.queue, shape_of(request))
        at = self._places.setdefault(at, at)
        old = self._where.get(job_id)
        if old == at:
            return
        if old is not None:
            self.drop(job_id)
        self._where[job_id] = at
        shapes = self._filed.setdefault(at[0], {})
        shapes.setdefault(at[1], PendingQueue()).add(job_id, request.priority, request.order)

    def drop(self, job_id: str) -> None:
        """The job left the queue or no longer waits for spot."""
        at = self._where.pop(job_id, None)
        if at is None:
            return
        shapes = self._filed[at[0]]
        filed = shapes[at[1]]
        filed.discard(job_id)
        if not filed:
            del shapes[at[1]]
            if not shapes:
                del self._filed[at[0]]

    def queues(self) -> Iterator[tuple[str, dict[Shape, PendingQueue]]]:
        """Each queue with waiters, and its waiters by shape in queue order (read-only)."""
        return iter(list(self._filed.items()))
