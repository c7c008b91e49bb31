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
reads one job per queue and shape (`Backlog.earlier_spot_waiters`), and a job whose request
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
    __slots__ = ("_filed", "_where")

    def __init__(self) -> None:
        # job id -> the request it was filed by (the backlog's cached one: no copy kept)
        self._where: dict[str, GangRequest] = {}
        self._filed: dict[str, dict[Shape, PendingQueue]] = {}  # queue -> shape -> jobs

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._where

    def file(self, request: GangRequest) -> None:
        """A cycle left the job of `request` unplaced: it waits, for spot when it wants it.
        A parked job is filed again in every cycle that tries it: by the same request, most
        often, which costs one look-up."""
        job_id = request.job_id
        old = self._where.get(job_id)
        if old is request:
            return
        if old is not None:
            self.drop(job_id)
        if not wants_spot(request):
            return
        self._where[job_id] = request
        shapes = self._filed.setdefault(request.queue, {})
        filed = shapes.setdefault(shape_of(request), PendingQueue())
        filed.add(job_id, request.priority, request.order)

    def drop(self, job_id: str) -> None:
        """The job left the queue or no longer waits for spot."""
        request = self._where.pop(job_id, None)
        if request is None:
            return
        shapes = self._filed[request.queue]
        shape = shape_of(request)
        filed = shapes[shape]
        filed.discard(job_id)
        if not filed:
            del shapes[shape]
            if not shapes:
                del self._filed[request.queue]

    def queues(self) -> Iterator[tuple[str, dict[Shape, PendingQueue]]]:
        """Each queue with waiters, and its waiters by shape in queue order (read-only)."""
        return iter(list(self._filed.items()))
