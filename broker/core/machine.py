"""The job lifecycle machine: sans-IO, in the manner of h11.

The shell feeds it one typed input at a time (`broker.core.inputs`) together with `now`, and
carries out the effects it returns, in order (`Machine.handle`). Behind this facade each job
has its own module:

- `submission`: which queue a job goes to and why it is refused;
- `agents`: which agent batches to apply (instance, sequence, resync) and cluster health;
- `backlog`: queue indexing, what an admission cycle looks at and when;
- `lifecycle`: the attempt lifecycle (dispatch to finish) and which jobs are live where;
- `accounting`: GPU-seconds, lost work and cost;
- `views`: read-only queries for the API and the dashboard.

The `Scheduler` owns capacity, flavors and quota; the machine asks it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from broker.core import deadline as deadlines
from broker.core import spotreturn
from broker.core.accounting import backoff_delay, work_since
from broker.core.agents import AgentTrack, AgentTracker
from broker.core.backlog import Backlog
from broker.core.effects import BatchApplied, Effect, Persist, Refused, Send, Submitted
from broker.core.inputs import (
    AgentBatch,
    CancelJob,
    Checkpoint,
    Cycle,
    DispatchAcked,
    Input,
    Restore,
    SubmitJob,
    Tick,
)
from broker.core.lifecycle import LIVE_STATES, TERMINAL, AttemptLifecycle, placement_of
from broker.core.records import JobRecord, demands_of, gang_request
from broker.core.risk import NoticeWindows
from broker.core.scheduler import Scheduler
from broker.core.submission import choose_queue, derive_job_id, queue_full, reject
from broker.core.types import Placement, PodSetDemand, Reason
from broker.core.views import JobViews
from schemas.agent import (
    CheckpointReport,
    ClusterSnapshot,
    EventBatch,
    GpuHealth,
    Heartbeat,
    NodeGone,
    NodeUpsert,
    SpotNotice,
    WorkloadStatus,
)
from schemas.api import SubmitReply
from schemas.config import BrokerConfig
from schemas.job import JobSpec

__all__ = ["LIVE_STATES", "TERMINAL", "AgentTrack", "Machine", "derive_job_id"]

MISSING_GRACE_S = 5.0


class Machine(AttemptLifecycle, JobViews):
    def __init__(
        self, config: BrokerConfig, scheduler: Scheduler | None = None, epoch: int = 0
    ) -> None:
        self.config = config
        self.scheduler = scheduler if scheduler is not None else Scheduler(config)
        self.epoch = epoch
        self.queues = {q.name: q for q in config.queues}
        self.jobs: dict[str, JobRecord] = {}
        self._demands: dict[str, tuple[PodSetDemand, ...]] = {}
        self.backlog = Backlog(self.queues)
        self.tracker = AgentTracker(self.scheduler, epoch)
        self._live: set[str] = set()
        self._live_on: dict[str, set[str]] = {}
        self._starting: set[str] = set()
        self._preempting: set[str] = set()
        self.reasons: dict[str, tuple[Reason, ...]] = {}
        self._order = 0
        t = config.timeouts
        lead = t.fence_lead_s
        self._fence_after = t.lost_after_s - lead if lead > 0 and t.lost_after_s > lead else 0.0
        # Spot economics (advice.py, deadline.py, spotreturn.py): notice windows per pool,
        # open jobs with a deadline, and when live jobs were last looked at for spot-return.
        self._windows = NoticeWindows()
        self._deadline_jobs: set[str] = set()
        self._next_return_scan = 0.0
        self._return_cursor = ""  # the last job a spot-return scan tried
        self.spot_return = True  # off only to measure what it earns (load/sim.py)

    @property
    def agents(self) -> dict[str, AgentTrack]:
        return self.tracker.tracks

    @property
    def wants_cycle(self) -> bool:
        return self.backlog.wants_cycle

    # ------------------------------------------------------------------ the one input API
    def handle(self, event: Input, now: float) -> list[Effect]:
        """Apply one input at time `now`; the effects are for the shell to carry out in order."""
        if isinstance(event, AgentBatch):
            return self._on_batch(event.cluster, event.batch, now)
        if isinstance(event, Cycle):
            return self._schedule(now)
        if isinstance(event, Tick):
            return self._tick(now)
        if isinstance(event, DispatchAcked):
            return self._on_dispatch_result(event.job_id, event.attempt, event.ok, event.error, now)
        if isinstance(event, SubmitJob):
            reply, effects = self._submit(
                event.spec,
                now,
                order=event.order,
                subject_queue=event.subject_queue,
                id_token=event.id_token,
            )
            effects.append(Submitted(reply))
            return effects
        if isinstance(event, Checkpoint):
            out: list[Effect] = []
            self._on_checkpoint(event.report, now, out)
            return out
        if isinstance(event, CancelJob):
            error, effects = self._cancel(event.job_id, event.reason, now)
            return [Refused(error)] if error is not None else effects
        if isinstance(event, Restore):
            self._restore(event.records, now)
            return self._resend_unacknowledged(now)
        raise TypeError(f"not a machine input: {type(event).__name__}")

    # ------------------------------------------------------------------ submission
    def _submit(
        self,
        spec: JobSpec,
        now: float,
        *,
        order: int | None = None,
        subject_queue: str | None = None,
        id_token: str | None = None,
    ) -> tuple[SubmitReply, list[Effect]]:
        """Accept or reject a job. Rejection changes nothing. A job without `job_id` is named
        `<name>-<id_token>` (the shell derives an unguessable token from the stream message),
        or `<name>-<order>` when no token is given."""
        queue = choose_queue(self.config, self.queues, spec, subject_queue)
        if isinstance(queue, SubmitReply):
            return queue, []
        if order is None:
            order = self._order + 1
        self._order = max(self._order, order)
        job_id = spec.job_id or derive_job_id(spec.name, id_token or str(order))
        existing = self.jobs.get(job_id)
        if existing is not None:
            return SubmitReply(accepted=True, job_id=job_id, duplicate=True), []
        pending = self.backlog.pending.get(queue)
        full = queue_full(queue, len(pending or ()), self.config.limits.max_pending_per_queue)
        if full is not None:
            return full, []
        demands = demands_of(spec)
        record = JobRecord(
            job_id=job_id, spec=spec, queue=queue, order=order, submitted_at=now, queued_at=now
        )
        problems = self.scheduler.check_feasible(gang_request(record, now, demands))
        if problems:
            text = "; ".join(r.message for r in problems)
            return reject(f"the gang can never be placed: {text}"), []
        self.jobs[job_id] = record
        self._demands[job_id] = demands
        self.backlog.enqueue(record)
        if spec.deadline is not None:
            self._deadline_jobs.add(job_id)  # deadline.py
        return SubmitReply(accepted=True, job_id=job_id), [
            Persist(record),
            self._event(record, "queued", now),
        ]

    def _cancel(self, job_id: str, reason: str, now: float) -> tuple[str | None, list[Effect]]:
        """Returns (error, effects). Cancelling a finished job is an error that changes nothing."""
        record = self.jobs.get(job_id)
        if record is None:
            return f"unknown job {job_id!r}", []
        if record.state in TERMINAL:
            verb = "has already" if record.state == "succeeded" else "is already"
            return f"job {job_id} {verb} {record.state}; nothing to cancel", []
        effects: list[Effect] = []
        self._finish(record, "cancelled", now, reason, effects)
        return None, effects

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, now: float) -> list[Effect]:
        """One admission cycle over the jobs that could have become admissible."""
        candidates = self.backlog.candidates(self.jobs, self._demands, now)
        if not candidates:
            return []
        result = self.scheduler.schedule(candidates, now)
        if result.admitted:
            self.backlog.admitted({self.jobs[job_id].queue for job_id, _ in result.admitted})
        effects: list[Effect] = []
        for job_id, placement in result.admitted:
            record = self.jobs[job_id]
            self.backlog.dequeue(record)
            self.reasons.pop(job_id, None)
            attempt = self._attempt_for(record, placement, now)
            # placement.note: a partial admission says so in the admitted event
            self._dispatch(record, attempt, now, effects, note=placement.note or None)
        for pre in result.preemptions:
            for victim_id in pre.victims:
                victim = self.jobs.get(victim_id)
                if victim is None or victim.state not in ("admitted", "running"):
                    continue
                cause = "preempted" if pre.kind == "within-queue" else "reclaimed"
                deadline = now + self.config.timeouts.checkpoint_grace_s
                self._begin_preempt(victim, cause, deadline, now, effects, reserve=False)
        for job_id, reasons in result.pending.items():
            self.reasons[job_id] = reasons
            pending = self.jobs.get(job_id)
            if (
                pending is not None
                and pending.avoid
                and any(r.code == "pool-avoided" for r in reasons)
            ):
                # Nothing but the avoided pool fits: widen (SkyPilot's EAGER_NEXT_REGION).
                pending.avoid = []
                self.backlog.fresh.add(job_id)
        return effects

    # ------------------------------------------------------------------ agents
    def _on_batch(self, cluster: str, batch: EventBatch, now: float) -> list[Effect]:
        admitted = self.tracker.admit(cluster, batch, now)
        if isinstance(admitted, list):
            return admitted
        if admitted.recovered:
            self.backlog.capacity_dirty = True
        effects: list[Effect] = []
        track = admitted.track
        for event in batch.events[admitted.start :]:
            self._apply(cluster, track, event, now, effects)
        effects.append(BatchApplied(cluster, batch.instance, batch.seq))
        return effects

    def _apply(
        self,
        cluster: str,
        track: AgentTrack,
        event: object,
        now: float,
        effects: list[Effect],
    ) -> None:
        if isinstance(event, Heartbeat):
            if (event.stale_s > 0) != (track.stale_s > 0):
                self.scheduler.set_cluster_stale(cluster, event.stale_s > 0)
                self.backlog.capacity_dirty = True
            track.stale_s = event.stale_s
            return
        if isinstance(event, ClusterSnapshot):
            self._snapshot(cluster, track, event, now, effects)
        elif isinstance(event, WorkloadStatus):
            self._workload(cluster, event, now, effects)
        elif isinstance(event, CheckpointReport):
            self._on_checkpoint(event, now, effects, cluster=cluster)
        elif isinstance(event, SpotNotice):
            for job_id in self.scheduler.spot_notice(cluster, event.node, event.deadline, now):
                self._spot(job_id, cluster, event, now, effects)
            self.backlog.capacity_dirty = True
        elif isinstance(event, NodeUpsert):
            lost = self.scheduler.upsert_node(cluster, event.node, now)
            self._lose_all(
                lost, "node-unusable", now, effects, cluster=cluster, node=event.node.name
            )
            self.backlog.capacity_dirty = True
        elif isinstance(event, NodeGone):
            lost = self.scheduler.remove_node(cluster, event.node, now)
            self._lose_all(lost, "node-lost", now, effects, cluster=cluster, node=event.node)
            self.backlog.capacity_dirty = True
        elif isinstance(event, GpuHealth):
            lost = self.scheduler.set_gpu_health(cluster, event.node, event.healthy, now)
            cause = f"gpu-failure (xid {event.xid})" if event.xid is not None else "gpu-failure"
            self._lose_all(lost, cause, now, effects, cluster=cluster, node=event.node)
            self.backlog.capacity_dirty = True

    def _snapshot(
        self,
        cluster: str,
        track: AgentTrack,
        snap: ClusterSnapshot,
        now: float,
        effects: list[Effect],
    ) -> None:
        lost = self.scheduler.apply_snapshot(cluster, snap.flavors, snap.nodes, now)
        track.synced = True
        self._lose_all(lost, "node-lost", now, effects, cluster=cluster)
        reported: set[tuple[str, int]] = set()
        for status in snap.workloads:
            reported.add((status.job_id, status.attempt))
            self._workload(cluster, status, now, effects, snapshot=True)
        for job_id in list(self._live_on.get(cluster, ())):
            record = self.jobs[job_id]
            current = record.current
            if current is None or current.cluster != cluster:
                continue
            if (job_id, current.attempt) in reported:
                continue
            settled = current.running_at is not None or (
                current.acked_at is not None and now - current.acked_at > MISSING_GRACE_S
            )
            if settled:
                self._lose(record, "workload-missing", now, effects)
        self.backlog.capacity_dirty = True

    # ------------------------------------------------------------------ time
    def _tick(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        timeouts = self.config.timeouts
        for cluster in self.tracker.silent(now, timeouts):
            self.scheduler.remove_cluster(cluster, now)
            self._lose_all(self._on_cluster(cluster), "cluster-lost", now, effects, cluster=cluster)
            self.backlog.capacity_dirty = True
        for job_id in list(self._preempting):
            record = self.jobs[job_id]
            pre = record.preempting
            if pre is None:
                self._preempting.discard(job_id)
            elif now >= pre.deadline:
                self._finish_preempt(record, now, effects)
        for job_id in list(self._starting):
            record = self.jobs[job_id]
            current = record.current
            if current is None or current.running_at is not None or record.preempting:
                self._starting.discard(job_id)
                continue
            limit = record.spec.start_timeout_s or timeouts.start_s
            if now - current.dispatched_at > limit:
                record.start_failures += 1
                self._end_attempt(record, current, "start-timeout", now, lost=True)
                effects.append(
                    Send(
                        current.cluster, self._cancel_cmd(job_id, current.attempt, "start timeout")
                    )
                )
                delay = backoff_delay(record, record.start_failures)
                self._requeue(
                    record, now, delay, effects, reason=f"not all replicas ran within {limit:g}s"
                )
        self.backlog.due(self.jobs, now)
        self._deadline_switches(now, effects)  # deadline.py
        if self.spot_return and now >= self._next_return_scan:  # spotreturn.py
            self._next_return_scan = now + spotreturn.SCAN_EVERY_S
            self._spot_returns(now, effects)
        return effects

    # ------------------------------------------------------------------ planned moves
    def _deadline_switches(self, now: float, effects: list[Effect]) -> None:
        """Jobs whose deadline slack ran out go to on-demand for good (deadline.py)."""
        for job_id in sorted(self._deadline_jobs):
            record = self.jobs[job_id]
            if record.state in TERMINAL:
                self._deadline_jobs.discard(job_id)
            elif deadlines.must_switch(record, now):
                record.deadline_on_demand = True
                record.spot_exhausted = True  # (also renews the cached request)
                effects.append(Persist(record))
                current = record.current
                if record.state == "queued":
                    record.reason = "deadline: too little slack left for spot; on-demand only"
                    self.backlog.fresh.add(job_id)
                elif current is not None and current.capacity_type == "spot":
                    self._planned_move(record, spotreturn.DEADLINE_MOVE, now, effects)

    def _spot_returns(self, now: float, effects: list[Effect]) -> None:
        """On-demand jobs that may use spot go back to it when that pays (spotreturn.py)."""
        tries = 0
        live = sorted(self._live)
        # Round robin from where the last scan stopped, so that jobs whose move keeps
        # failing early in the order do not starve the rest.
        start = bisect.bisect_right(live, self._return_cursor)
        for job_id in live[start:] + live[:start]:
            if tries >= spotreturn.MAX_TRIES_PER_SCAN:
                break
            record = self.jobs[job_id]
            if spotreturn.may_return(record, now):
                tries += 1
                self._return_cursor = job_id
                self._planned_move(record, spotreturn.SPOT_RETURN, now, effects)

    def _planned_move(
        self, record: JobRecord, cause: str, now: float, effects: list[Effect]
    ) -> None:
        """Move a running job by choice, make-before-break: reserve the new placement, then
        the spot-notice path checkpoints, cancels the old attempt and dispatches the new one."""
        current = record.current
        if current is None or record.state != "running" or current.running_at is None:
            return
        request = gang_request(record, now, self._demands[record.job_id])
        if cause == spotreturn.SPOT_RETURN:
            request.capacity = "spot"
            request.spot_exhausted = False
        got = self.scheduler.reserve(request, now, replacing_attempt=current.attempt)
        if not isinstance(got, Placement):
            return
        if cause == spotreturn.SPOT_RETURN and not spotreturn.worth_returning(
            record, current, got.expected_cost_per_hour, now
        ):
            self.scheduler.release(record.job_id, request.attempt)
            return
        replacement = self._attempt_for(record, got, now)
        deadline = now + spotreturn.move_grace_s(record)
        self._begin_preempt(record, cause, deadline, now, effects, reserve=False)
        if record.preempting is not None:
            record.preempting.replacement = replacement
            if cause == spotreturn.SPOT_RETURN:
                record.spot_exhausted = False

    def _on_cluster(self, cluster: str) -> list[str]:
        """Jobs that hold anything on the cluster: a live attempt, or a reserved replacement."""
        jobs = set(self._live_on.get(cluster, ()))
        for job_id in self._preempting:
            pre = self.jobs[job_id].preempting
            rep = pre.replacement if pre is not None else None
            if rep is not None and rep.cluster == cluster:
                jobs.add(job_id)
        return sorted(jobs)

    # ------------------------------------------------------------------ recovery after restart
    def _restore(self, records: Iterable[JobRecord], now: float) -> None:
        """Rebuild from persisted records. Live attempts are assumed to hold their placement
        until their agents resend snapshots (or their clusters are declared lost)."""
        for record in records:
            self.jobs[record.job_id] = record
            self._demands[record.job_id] = demands_of(record.spec)
            self._order = max(self._order, record.order)
            if record.state in TERMINAL:
                continue
            if record.spec.deadline is not None:
                self._deadline_jobs.add(record.job_id)  # deadline.py (live ones too)
            if record.state == "queued":
                self.backlog.enqueue(record)
                continue
            current = record.current
            if current is None:
                record.state = "queued"
                self.backlog.enqueue(record)
                continue
            request = gang_request(record, now, self._demands[record.job_id])
            request.attempt = current.attempt
            self.scheduler.assume(request, placement_of(current))
            self._track_live(record, current.cluster)
            if current.running_at is None:
                self._starting.add(record.job_id)
            if record.preempting is not None:
                self._preempting.add(record.job_id)
            if record.preempting is not None and record.preempting.replacement is not None:
                rep = record.preempting.replacement
                request.attempt = rep.attempt
                self.scheduler.assume(request, placement_of(rep))
            since = work_since(record, current)
            self.scheduler.note_progress(record.job_id, current.attempt, since)
            self.tracker.assume(current.cluster, now)
        # Restored queued jobs count as parked, not fresh: each was tried before the restart
        # (or is as good as a parked one), and no cluster has reported yet. The first cycle then
        # takes the `lookahead` heads of each queue, not all 100,000 jobs at once, which would
        # keep a just-restarted broker deaf for seconds.
        self.backlog.fresh.clear()
        self.backlog.capacity_dirty = True

    def _resend_unacknowledged(self, now: float) -> list[Effect]:
        """After a restart: send again every dispatch persisted without an acknowledgement.
        The previous leader may have died before or while sending it; agents acknowledge a
        duplicate (job_id, attempt) without starting a second copy. The start timeout counts
        from this send."""
        effects: list[Effect] = []
        for job_id in sorted(self._starting):
            record = self.jobs[job_id]
            current = record.current
            if (
                current is None
                or current.acked_at is not None
                or current.running_at is not None
                or record.preempting is not None
            ):
                continue
            current.dispatched_at = now
            effects.append(self._dispatch_send(record, current))
        return effects
