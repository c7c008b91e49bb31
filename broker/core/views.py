"""Read-only queries over the machine's components, for the API, the CLI and the dashboard.

`JobViews` holds the components it reads (the job registry, the lifecycle, the backlog, the agent
tracker and the scheduler) and asks them through their public methods; it changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from broker.core.accounting import accounting, attempt_gpus, attempt_view
from broker.core.agents import AgentTracker
from broker.core.backlog import Backlog
from broker.core.elastic import size_text
from broker.core.lifecycle import AttemptLifecycle
from broker.core.reasons import pending_reason
from broker.core.records import JobRecord, gang_request, preempting_text, spot_ok
from broker.core.registry import JobRegistry
from broker.core.scheduler import Scheduler
from broker.core.speed import work_price_text
from broker.core.states import TERMINAL
from schemas.api import (
    CheckpointView,
    ClusterView,
    FlavorView,
    JobView,
    PendingReason,
    QueueView,
    WhyView,
)


class JobViews:
    def __init__(
        self,
        registry: JobRegistry,
        lifecycle: AttemptLifecycle,
        backlog: Backlog,
        tracker: AgentTracker,
        scheduler: Scheduler,
    ) -> None:
        self._registry = registry
        self._jobs = registry.records
        self._lifecycle = lifecycle
        self._backlog = backlog
        self._tracker = tracker
        self._scheduler = scheduler

    def job_view(self, job_id: str, now: float, *, with_spec: bool = True) -> JobView | None:
        record = self._jobs.get(job_id)
        if record is None:
            return None
        attempts = [attempt_view(a, attempt_gpus(record, a), now) for a in record.attempts]
        current = record.current
        ckpt = record.latest_checkpoint
        return JobView(
            job_id=record.job_id,
            name=record.spec.name,
            queue=record.queue,
            state=record.state,
            priority=record.spec.priority,
            submitted_at=record.submitted_at,
            gpus=record.total_gpus,
            attempt=record.attempt,
            cluster=current.cluster if current else None,
            flavor=current.flavor if current else None,
            reason=record.reason,
            waiting=self._waiting_line(record, now),
            size=size_text(record.spec, current.assignment, bool(current.grow_refused)) or None
            if current
            else None,
            latest_checkpoint=CheckpointView(
                step=ckpt.step, uri=ckpt.uri, at=ckpt.at, attempt=ckpt.attempt
            )
            if ckpt
            else None,
            attempts=attempts,
            accounting=accounting(record, attempts),
            spec=record.spec if with_spec else None,
        )

    def list_jobs(
        self,
        now: float,
        *,
        queue: str | None = None,
        state: str | None = None,
        cluster: str | None = None,
        limit: int = 1000,
    ) -> list[JobView]:
        out: list[JobView] = []
        for record in _matching(self._jobs.values(), queue, state, cluster, None):
            view = self.job_view(record.job_id, now, with_spec=False)
            if view is not None:
                out.append(view)
            if len(out) >= limit:
                break
        return out

    def jobs_page(
        self,
        now: float,
        *,
        queue: str | None = None,
        state: str | None = None,
        cluster: str | None = None,
        name: str | None = None,
        offset: int = 0,
        limit: int = 50,
    ) -> tuple[int, list[JobView]]:
        """Newest first: how many jobs match, and the views of one page of them. Only the page
        is rendered, so a page costs one pass over the records whatever their number."""
        total = 0
        page: list[str] = []
        end = offset + limit
        for record in _matching(reversed(self._jobs.values()), queue, state, cluster, name):
            if offset <= total < end:
                page.append(record.job_id)
            total += 1
        views = [self.job_view(j, now, with_spec=False) for j in page]
        return total, [v for v in views if v is not None]

    def first_reason(self, job_id: str) -> str | None:
        """The scheduler's first reason for a queued job (what `muster status` shows)."""
        reasons = self._registry.reasons.get(job_id)
        return reasons[0].message if reasons else None

    def oldest_pending(self) -> dict[str, float]:
        """Per queue, when its longest-waiting pending job was submitted."""
        out: dict[str, float] = {}
        for queue, ids in self._backlog.pending.items():
            if ids:
                out[queue] = min(self._jobs[j].submitted_at for j in ids)
        return out

    def _pending_reasons(self, record: JobRecord, now: float) -> list[PendingReason]:
        reasons: list[PendingReason] = []
        if record.state == "queued":
            if record.not_before > now:
                reasons.append(
                    PendingReason(
                        code="backoff",
                        message=f"backing off for {record.not_before - now:.1f}s more "
                        f"after: {record.reason}",
                    )
                )
            # pending_reason: the API form of a core reason, with its numbers
            reasons.extend(
                self._timed(pending_reason(r), record.job_id, now)
                for r in self._registry.reasons.get(record.job_id, ())
            )
        elif record.state == "preempting" and record.preempting is not None:
            reasons.append(
                PendingReason(
                    code="preempting",
                    message=f"{preempting_text(record.preempting)}; waiting for a checkpoint "
                    f"for {max(0.0, record.preempting.deadline - now):.0f}s more",
                )
            )
        return reasons

    def _waiting_line(self, record: JobRecord, now: float) -> str | None:
        """`code: message` of the first reason, for the status table's REASON column."""
        if record.state not in ("queued", "preempting"):
            return None
        reasons = self._pending_reasons(record, now)
        if not reasons:
            return "not-yet-considered: waiting for the next cycle"
        return f"{reasons[0].code}: {reasons[0].message}"

    def _timed(self, reason: PendingReason, job_id: str, now: float) -> PendingReason:
        """A reason that waits for a time, with how long from `now`."""
        if reason.code != "preemption-protected":
            return reason
        found = self._scheduler.protection(job_id)
        if found is None:
            return reason
        reason.message += f"; it lapses in {max(0.0, found[0] - now):.0f}s"
        return reason

    def why(self, job_id: str, now: float) -> WhyView | None:
        record = self._jobs.get(job_id)
        if record is None:
            return None
        reasons = self._pending_reasons(record, now)
        position: int | None = None
        candidates: list[PendingReason] = []
        waiting_for: str | None = None
        if record.state == "queued":
            if not reasons:
                reasons.append(
                    PendingReason(code="not-yet-considered", message="waiting for the next cycle")
                )
            pending = self._backlog.pending.get(record.queue)
            position = pending.rank(job_id) if pending is not None else 0
            request = gang_request(record, now, self._registry.demands(job_id))
            candidates = [pending_reason(r) for r in self._scheduler.pool_reasons(request)]
            waiting_for = _waiting_for(reasons, candidates)
        elif record.state == "preempting":
            waiting_for = "checkpoint"
        else:
            queues = {q.name: q for q in self._scheduler.config.queues}
            order = queues[record.queue].flavor_order if record.queue in queues else []
            reasons.extend(_placement_reasons(record, order))
        return WhyView(
            job_id=job_id,
            state=record.state,
            reasons=reasons,
            position=position,
            queue=record.queue,
            waiting_for=waiting_for,
            candidates=candidates,
            work_price=self._work_price(record, now),
        )

    def _work_price(self, record: JobRecord, now: float) -> str | None:
        """The expected $ per unit of work of the job's pool (or the best) and the next best."""
        current = record.current
        if record.state in TERMINAL or record.state == "preempting":
            return None
        request = gang_request(record, now, self._registry.demands(record.job_id))
        chosen = (current.cluster, current.flavor) if current is not None else None
        return work_price_text(self._scheduler.work_prices(request, now), chosen, record.speeds)

    def queue_views(self) -> list[QueueView]:
        counts = {q: len(p) for q, p in self._backlog.pending.items()}
        return self._scheduler.queue_views(counts)

    def cluster_views(self, now: float) -> list[ClusterView]:
        names = sorted(set(self._tracker.tracks) | set(self._scheduler.known_clusters()))
        out = []
        for name in names:
            track = self._tracker.tracks.get(name)
            out.append(
                ClusterView(
                    name=name,
                    health=track.health if track else "lost",
                    last_heartbeat=track.last_heard if track else None,
                    flavors=self._with_breakers(name, self._scheduler.flavor_views(name, now)),
                    running_jobs=len(self._lifecycle.live_on(name)),
                    stale_s=track.stale_s if track else 0.0,
                )
            )
        return out

    def _with_breakers(self, cluster: str, flavors: list[FlavorView]) -> list[FlavorView]:
        health = self._lifecycle.health
        for f in flavors:
            b = health.view((cluster, f.name))
            if b is not None:
                f.breaker = b.state
                f.breaker_failures = b.failures
                f.breaker_reason = health.reason((cluster, f.name)) or b.cause
        return flavors

    def pending_count(self) -> int:
        return sum(len(p) for p in self._backlog.pending.values())

    def live_count(self) -> int:
        return self._lifecycle.live_count()


def _placement_reasons(record: JobRecord, order: list[str]) -> list[PendingReason]:
    """Why a job that is placed (or has ended) got its pool, or how it ended. `order`: its
    queue's flavor order (Kueue's), which comes before cost."""
    last = record.attempts[-1] if record.attempts else None
    if record.state in TERMINAL:
        where = (
            f"; its last attempt (#{last.attempt}) ran on {last.cluster}/{last.flavor}"
            if last
            else ""
        )
        text = f"the job has {'ended: ' if record.state != 'cancelled' else 'been '}{record.state}"
        return [PendingReason(code="ended", message=f"{text}: {record.reason or '-'}{where}")]
    if last is None or record.state not in ("admitted", "running"):
        return []
    spec = record.spec
    spot = last.capacity_type == "spot"
    if record.deadline_on_demand:
        why = "its deadline put it on on-demand"
    elif spec.capacity in ("spot", "on-demand"):
        why = f"the job asks for {spec.capacity} capacity"
    elif spec.capacity == "spot-then-on-demand" and not spot_ok(spec) and not record.spot_exhausted:
        why = _NO_CHECKPOINT + (_SPOT_STILL if spot else _SPOT_DEARER)
    elif spec.capacity == "spot-then-on-demand":
        why = "spot first (capacity spot-then-on-demand)" if spot else _fallback_text(record)
    elif not spot and record.spot_fallback:
        why = record.spot_fallback  # it left spot to an earlier spot-only job
    elif not spot and not spot_ok(spec):
        why = (
            "the job writes no checkpoint, so it takes on-demand before spot (give it a "
            "checkpoint, or label muster.dev/spot-ok, or set its queue's spot_without_checkpoint)"
        )
    elif last.flavor_class in order:
        rank = order.index(last.flavor_class)
        why = (
            f"flavor class {last.flavor_class} is #{rank + 1} in queue {record.queue}'s flavor "
            f"order ({', '.join(order)}): "
            + ("its first choice" if rank == 0 else "the ones before it had no room")
        )
    else:
        why = "the lowest expected cost per hour among the pools with room (price and spot risk)"
    price = f"${last.price_per_gpu_hour:g}/GPU-h" if last.price_per_gpu_hour else "no price"
    kind = f"{last.capacity_type or 'unknown capacity'}, {last.gpu_type or 'any GPU'}, {price}"
    where = f"on {last.cluster}/{last.flavor} ({kind}): {why}"
    placed = [PendingReason(code="placed", message=where)]
    size = size_text(spec, last.assignment, bool(last.grow_refused))
    if size:
        placed.append(PendingReason(code="elastic", message=size))
    if last.grow_refused:  # typed: the cluster refused a growth of this attempt, and why
        refused = PendingReason(
            code="grow-refused", message=last.grow_refused, cluster=last.cluster, flavor=last.flavor
        )
        placed.append(refused)
    return placed


_NO_CHECKPOINT = "the job writes no checkpoint, so a reclaim loses its whole run: "
_SPOT_STILL = "with that loss priced in, spot was still the cheapest work with room"
_SPOT_DEARER = (
    "with that loss priced in, spot cost more per unit of work than this pool, or had no room "
    "(give it a checkpoint, or label muster.dev/spot-ok, or set its queue's "
    "spot_without_checkpoint)"
)


def _fallback_text(record: JobRecord) -> str:
    """Why a spot-then-on-demand job runs on on-demand, naming the setting that decided."""
    policy = record.spec.spot
    if not record.spot_exhausted:
        return "no spot pool could ever host the gang, so on-demand is allowed at once"
    if record.spot_preemptions >= policy.fallback_after_preemptions:
        return (
            f"fell back to on-demand after {record.spot_preemptions} spot preemptions "
            f"(spot.fallback_after_preemptions: {policy.fallback_after_preemptions})"
        )
    if record.spot_fallback:
        return record.spot_fallback
    return (
        "fell back to on-demand after waiting for spot (spot.fallback_after_wait_s: "
        f"{policy.fallback_after_wait_s:g}s), or as spot attempts made no progress"
    )


_WAIT_FOR = {
    "backoff": "backoff",
    "waiting-for-preemption": "capacity (victims are being preempted)",
    "waiting-for-nodes": "nodes an autoscaled pool is adding",
    "preemption-protected": "the victims' minimum runtime (preemption_min_runtime_s)",
    "strict-fifo-blocked": "the head of its StrictFIFO queue",
    "max-admissions": "the next cycle",
    "no-clusters": "a cluster to report",
    "spot-held": "on-demand capacity (the spot that fits is kept for an earlier spot-only job)",
}


def _waiting_for(reasons: list[PendingReason], candidates: list[PendingReason]) -> str:
    """One phrase: what must change for the job to start."""
    for r in reasons:
        if r.code in _WAIT_FOR:
            return _WAIT_FOR[r.code]
    codes = {c.code for c in candidates}
    if "fits-now" in codes:
        return "the next cycle"
    if codes & {"spot-first", "insufficient-capacity", "topology-unfit"}:
        return "capacity"
    if "quota-exceeded" in codes:
        return "quota"
    if codes & {"pool-avoided", "cluster-unhealthy", "circuit-open"}:
        return "a healthy cluster"
    if not candidates:
        return "a cluster to report"
    return "a flavor it accepts"


def _matching(
    records: Iterable[JobRecord],
    queue: str | None,
    state: str | None,
    cluster: str | None,
    name: str | None,
) -> Iterator[JobRecord]:
    """The records that pass every filter given (`name`: a substring of the job's name)."""
    for record in records:
        if queue is not None and record.queue != queue:
            continue
        if state is not None and record.state != state:
            continue
        if name is not None and name not in record.spec.name:
            continue
        if cluster is not None and all(a.cluster != cluster for a in record.attempts):
            continue  # jobs that run or ran there
        yield record
