"""The job registry: every job the broker knows, finished ones included.

It owns which jobs exist (`records`), each job's gang demands (computed once, when the job is
added) and the scheduler's latest reasons why a queued job waits. Other components change
the records themselves (their state is the record's), never which records there are.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from broker.core.records import JobRecord, demands_of
from broker.core.sharing import ByIdentity, interned_tuple, share_spec
from broker.core.types import PodSetDemand, Reason
from schemas.job import PodSet


class JobRegistry:
    def __init__(self) -> None:
        # Public for reading and for changing a record's fields; `add` is the one writer.
        self.records: dict[str, JobRecord] = {}
        self._demands: dict[str, tuple[PodSetDemand, ...]] = {}
        self._reasons: dict[str, tuple[Reason, ...]] = {}
        self._by_gang: ByIdentity[list[PodSet], tuple[PodSetDemand, ...]] = ByIdentity()

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.records

    def add(self, record: JobRecord, demands: tuple[PodSetDemand, ...] | None = None) -> None:
        """Register a submitted or restored job (`demands`: its spec's, if already computed).
        What it holds alike with other jobs becomes the shared copy (sharing.py)."""
        share_record(record)
        self.records[record.job_id] = record
        if demands is None:
            # A restore registers 100,000 jobs whose gangs are a few shared lists.
            gang = record.spec.gang
            demands = self._by_gang.get(gang)
            if demands is None:
                demands = self._by_gang.put(gang, interned_tuple(demands_of(record.spec)))
        else:
            demands = interned_tuple(demands)
        self._demands[record.job_id] = demands

    def remove(self, job_id: str) -> None:
        """Forget an ended job (its retention ran out): its id may be submitted again."""
        self.records.pop(job_id, None)
        self._demands.pop(job_id, None)
        self._reasons.pop(job_id, None)

    def demands(self, job_id: str) -> tuple[PodSetDemand, ...]:
        """The gang of a registered job."""
        return self._demands[job_id]

    @property
    def all_demands(self) -> Mapping[str, tuple[PodSetDemand, ...]]:
        """Every registered job's gang, by job id (read-only)."""
        return self._demands

    @property
    def reasons(self) -> Mapping[str, tuple[Reason, ...]]:
        """Why each queued job the last cycle looked at was not admitted (read-only)."""
        return self._reasons

    def set_reasons(self, job_id: str, reasons: tuple[Reason, ...]) -> None:
        self._reasons[job_id] = reasons

    def clear_reasons(self, job_id: str) -> None:
        """The job was admitted or finished: it no longer waits."""
        self._reasons.pop(job_id, None)


def share_record(record: JobRecord) -> None:
    """Share the record's spec parts and intern the names its attempts repeat (a restored
    record's strings are each its own copy)."""
    share_spec(record.spec)
    record.queue = sys.intern(record.queue)
    for a in record.attempts:
        a.cluster = sys.intern(a.cluster)
        a.flavor = sys.intern(a.flavor)
        a.flavor_class = sys.intern(a.flavor_class)
        a.capacity_type = sys.intern(a.capacity_type)
        a.gpu_type = sys.intern(a.gpu_type)
