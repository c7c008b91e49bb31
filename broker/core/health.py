"""Pool health from dispatch outcomes: a circuit breaker per cluster x flavor.

A cluster can be reachable, heartbeating and full of free nodes, and still refuse every
Dispatch (`ok=False`: a broken RBAC binding, a webhook that rejects the objects) or acknowledge
it and never create anything. Cluster health (`agents.py`) cannot see that; outcomes can. Each
pool keeps a breaker, in the manner of the circuit breakers of service meshes:

- closed: admissions go ahead. A failure (a refused dispatch, or an acknowledged one the agent
  never reports within `timeouts.dispatch_report_s`) counts; `breaker_failures` failures in a
  row, each of a different job, open it. Any report of a dispatched attempt resets the count.
- open: the pool takes no placements (the placement filter skips it; `muster why` and
  `muster clusters` say why) for a cool-down, which doubles with each failed probe up to
  `MAX_COOL_DOWN_FACTOR` times the configured one.
- half-open: after the cool-down one admission goes through as a probe; while it is in flight
  the pool is closed to everyone else. Its report closes the breaker; its failure opens it again.

Failures must come from different jobs, so one job that some agent refuses (a bad spec) cannot
close a pool to everyone. An honest pool, whose dispatches are all taken and reported, never
fails and so is never skipped (a Hypothesis property, tests/core/test_pool_health.py).

The breakers are the one owner of this fact; the scheduler's per-pool block is derived from
them in one place (`_sync`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from broker.core.scheduler import Scheduler
from broker.core.types import PoolKey

BreakerState = Literal["closed", "open", "half-open"]
MAX_COOL_DOWN_FACTOR = 16  # the longest cool-down, in multiples of the configured one
MAX_BREAKERS = 65_536  # pools remembered at once (closed, healthy ones are dropped first)
MAX_CHANGES = 1024  # transitions kept for the shell to log (`drain_changes`)


@dataclass(slots=True)
class Breaker:
    state: BreakerState = "closed"
    failures: int = 0  # in a row, since the last report
    failed_jobs: tuple[str, ...] = ()  # the jobs behind `failures` (distinct)
    cause: str = ""  # the latest failure, said in `muster why`
    retry_at: float = 0.0  # open: when the next probe may go
    cool_down_s: float = 0.0  # open: the current cool-down
    probe: tuple[str, int] | None = None  # half-open: the (job, attempt) in flight
    trips: int = 0  # times opened, ever (a metric)


@dataclass(frozen=True, slots=True)
class BreakerView:
    state: BreakerState
    failures: int
    cause: str
    retry_at: float | None


class PoolHealth:
    def __init__(self, scheduler: Scheduler, failures: int, cool_down_s: float) -> None:
        self._scheduler = scheduler
        self._threshold = failures  # 0 = breakers off
        self._cool_down_s = cool_down_s
        self._breakers: dict[PoolKey, Breaker] = {}
        # (pool, new state, cause): what the shell logs, naming the offender
        self._changes: deque[tuple[PoolKey, BreakerState, str]] = deque(maxlen=MAX_CHANGES)

    # ------------------------------------------------------------------ outcomes
    def failure(self, pool: PoolKey, job_id: str, attempt: int, cause: str, now: float) -> None:
        """A dispatch to `pool` was refused or never reported."""
        if self._threshold <= 0:
            return
        b = self._breaker(pool)
        b.cause = cause
        if b.state == "half-open":
            if b.probe == (job_id, attempt):
                self._open(pool, b, now, min(b.cool_down_s * 2, self._max_cool_down))
            return
        if b.state == "open" or job_id in b.failed_jobs:
            return
        b.failures += 1
        b.failed_jobs = (*b.failed_jobs, job_id)[-self._threshold :]
        if b.failures >= self._threshold:
            self._open(pool, b, now, self._cool_down_s)

    def success(self, pool: PoolKey, job_id: str, attempt: int) -> bool:
        """The agent reported a dispatched attempt: the pool takes work. True when that
        lifted a block (the pool takes placements again)."""
        b = self._breakers.get(pool)
        if b is None:
            return False
        if b.state == "half-open" and b.probe not in (None, (job_id, attempt)):
            return False  # a late report of an earlier attempt says little; wait for the probe
        if b.state == "open":
            return False  # the cool-down runs its course; a probe decides
        lifted = b.state != "closed"
        b.state = "closed"
        b.failures = 0
        b.failed_jobs = ()
        b.probe = None
        b.cool_down_s = 0.0
        if lifted:
            self._sync(pool, b)
        return lifted

    def dispatched(self, pool: PoolKey, job_id: str, attempt: int) -> None:
        """An attempt went to `pool`: in a half-open pool it is the probe, and the pool takes
        nothing else until it is decided."""
        b = self._breakers.get(pool)
        if b is not None and b.state == "half-open" and b.probe is None:
            b.probe = (job_id, attempt)
            self._sync(pool, b)

    def abandoned(self, pool: PoolKey, job_id: str, attempt: int) -> None:
        """An attempt ended for a reason that says nothing about the pool (cancelled by its
        user, preempted): a probe that ends so frees the pool for the next probe."""
        b = self._breakers.get(pool)
        if b is not None and b.state == "half-open" and b.probe == (job_id, attempt):
            b.probe = None
            self._sync(pool, b)

    def tick(self, now: float) -> bool:
        """Open breakers whose cool-down ran out go half-open; True when any did."""
        due = [k for k, b in self._breakers.items() if b.state == "open" and now >= b.retry_at]
        for pool in due:
            b = self._breakers[pool]
            b.state = "half-open"
            b.probe = None
            self._sync(pool, b)
        return bool(due)

    # ------------------------------------------------------------------ views
    def view(self, pool: PoolKey) -> BreakerView | None:
        b = self._breakers.get(pool)
        if b is None or (b.state == "closed" and not b.failures):
            return None
        return BreakerView(b.state, b.failures, b.cause, b.retry_at if b.state == "open" else None)

    def reason(self, pool: PoolKey) -> str | None:
        """Why the pool takes no placements now, or None."""
        return self._scheduler.pool_blocked(pool)

    def blocked(self, pool: PoolKey) -> bool:
        b = self._breakers.get(pool)
        return b is not None and _blocks(b)

    def drain_changes(self) -> list[tuple[PoolKey, BreakerState, str]]:
        """Breaker transitions since the last call, oldest first (the shell logs them)."""
        out = list(self._changes)
        self._changes.clear()
        return out

    def trips(self) -> int:
        return sum(b.trips for b in self._breakers.values())

    def open_pools(self) -> list[PoolKey]:
        return sorted(k for k, b in self._breakers.items() if b.state != "closed")

    # ------------------------------------------------------------------ inside
    @property
    def _max_cool_down(self) -> float:
        return self._cool_down_s * MAX_COOL_DOWN_FACTOR

    def _breaker(self, pool: PoolKey) -> Breaker:
        b = self._breakers.get(pool)
        if b is None:
            if len(self._breakers) >= MAX_BREAKERS:
                for k in [k for k, v in self._breakers.items() if v.state == "closed"]:
                    del self._breakers[k]
            b = self._breakers[pool] = Breaker()
        return b

    def _open(self, pool: PoolKey, b: Breaker, now: float, cool_down_s: float) -> None:
        b.state = "open"
        b.cool_down_s = cool_down_s
        b.retry_at = now + cool_down_s
        b.probe = None
        b.trips += 1
        self._sync(pool, b)

    def _sync(self, pool: PoolKey, b: Breaker) -> None:
        """The scheduler's per-pool block follows the breaker; set here and nowhere else."""
        if b.probe is None:  # a probe going out is no transition worth a log line
            self._changes.append((pool, b.state, b.cause))
        reason = None
        if b.state == "open":
            reason = (
                f"circuit open after {b.failures} failed dispatches in a row, the last: "
                f"{b.cause}; no placements here for {b.cool_down_s:g}s, then one probe"
            )
        elif b.state == "half-open" and b.probe is not None:
            reason = f"circuit half-open: probe {b.probe[0]} (attempt {b.probe[1]}) in flight"
        probing = b.state == "half-open" and b.probe is None
        self._scheduler.set_pool_blocked(pool, reason, probing=probing)


def _blocks(b: Breaker) -> bool:
    return b.state == "open" or (b.state == "half-open" and b.probe is not None)
