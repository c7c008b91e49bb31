"""One queue's pending jobs, kept in admission order so a cycle reads only the heads it needs.

An admission cycle looks at the first `lookahead` ready jobs of each queue. Scanning every
pending job to find them made a cycle cost O(queue depth); here jobs stay sorted by
(-priority, submit order) in a bucketed sorted list (sorted sub-lists of at most `_LOAD * 2`
keys), so adding or removing a job costs O(log n + _LOAD) and reading the heads costs
O(heads + jobs in backoff ahead of them).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from itertools import chain

QueueKey = tuple[int, int, str]  # (-priority, order, job_id): unique per job
_LOAD = 512


class PendingQueue:
    """An ordered set of job ids with O(log n) add/remove and ordered iteration."""

    __slots__ = ("_keys", "_lists", "_maxes")

    def __init__(self) -> None:
        self._lists: list[list[QueueKey]] = []
        self._maxes: list[QueueKey] = []
        self._keys: dict[str, QueueKey] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._keys

    def __iter__(self) -> Iterator[str]:
        """Job ids in admission order."""
        for lst in self._lists:
            for key in lst:
                yield key[2]

    def entries(self) -> Iterator[QueueKey]:
        """The jobs' keys in admission order (a C-level iterator: a cycle starts one for each
        queue and shape of the spot waiters and mostly reads only its first key)."""
        return chain.from_iterable(self._lists)

    def add(self, job_id: str, priority: int, order: int) -> None:
        key = (-priority, order, job_id)
        old = self._keys.get(job_id)
        if old == key:
            return
        if old is not None:
            self._remove_key(old)
        self._keys[job_id] = key
        lists, maxes = self._lists, self._maxes
        if not lists:
            lists.append([key])
            maxes.append(key)
            return
        i = bisect_left(maxes, key)
        if i == len(maxes):
            i -= 1
        lst = lists[i]
        insort(lst, key)
        maxes[i] = lst[-1]
        if len(lst) > 2 * _LOAD:
            lists.insert(i + 1, lst[_LOAD:])
            del lst[_LOAD:]
            maxes[i] = lst[-1]
            maxes.insert(i + 1, lists[i + 1][-1])

    def add_many(self, items: list[tuple[str, int, int]]) -> None:
        """Add (job id, priority, order) of many jobs at once (a restore): one sort of every
        key instead of an insertion each."""
        for job_id, priority, order in items:
            self._keys[job_id] = (-priority, order, job_id)
        keys = sorted(self._keys.values())
        self._lists = [keys[at : at + _LOAD] for at in range(0, len(keys), _LOAD)]
        self._maxes = [lst[-1] for lst in self._lists]

    def discard(self, job_id: str) -> None:
        key = self._keys.pop(job_id, None)
        if key is not None:
            self._remove_key(key)

    def _remove_key(self, key: QueueKey) -> None:
        i = bisect_left(self._maxes, key)
        lst = self._lists[i]
        del lst[bisect_left(lst, key)]
        if lst:
            self._maxes[i] = lst[-1]
        else:
            del self._lists[i]
            del self._maxes[i]

    def heads(self, n: int, ready: Callable[[str], bool]) -> list[str]:
        """The first `n` job ids (in admission order) for which `ready` holds."""
        out: list[str] = []
        if n <= 0:
            return out
        for lst in self._lists:
            for key in lst:
                if ready(key[2]):
                    out.append(key[2])
                    if len(out) >= n:
                        return out
        return out

    def nth_key(self, n: int) -> QueueKey | None:
        """The key of the job `n` jobs behind the head (0 = the head), None when there are
        not that many: every job whose key is below it is among the first `n`."""
        for lst in self._lists:
            if n < len(lst):
                return lst[n]
            n -= len(lst)
        return None

    def rank(self, job_id: str) -> int:
        """How many jobs are ahead of `job_id` (its position, 0 = head)."""
        key = self._keys.get(job_id)
        if key is None:
            return len(self._keys)
        i = bisect_left(self._maxes, key)
        return sum(len(lst) for lst in self._lists[:i]) + bisect_left(self._lists[i], key)
