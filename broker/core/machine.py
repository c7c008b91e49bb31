"""The job lifecycle machine: sans-IO, in the manner of h11.

The shell feeds it inputs (a submission, an agent's event batch, a dispatch result, the passing
of time) together with `now`, and carries out the effects it returns, in order. The machine owns
the job records and the per-agent sequence tracking; the `Scheduler` owns capacity and quota.

Invariants kept here:
- a job has at most one live attempt, and every command carries (job_id, attempt, epoch);
- a record is persisted before the dispatch it describes is sent;
- anything an agent reports about an attempt that is not the job's live one is cancelled.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from broker.core.effects import Effect, Persist, Publish, Send
from broker.core.pending import PendingQueue
from broker.core.policy import no_progress_reason, no_progress_verdict
from broker.core.reasons import pending_reason
from broker.core.records import (
    AttemptRecord,
    AvoidPool,
    JobRecord,
    LatestCheckpoint,
    Preempting,
    demands_of,
    gang_request,
)
from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, Placement, PodSetDemand, Reason
from schemas.agent import (
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    EventBatch,
    FlavorInfo,
    GpuHealth,
    Heartbeat,
    NodeGone,
    NodeUpsert,
    PodSetAssignment,
    Resync,
    SpotNotice,
    WorkloadStatus,
)
from schemas.api import (
    Accounting,
    AttemptView,
    CheckpointView,
    ClusterHealth,
    ClusterView,
    EventKind,
    JobEvent,
    JobState,
    JobView,
    PendingReason,
    QueueView,
    SubmitReply,
    WhyView,
)
from schemas.config import BrokerConfig
from schemas.job import JobSpec

LIVE_STATES: frozenset[str] = frozenset({"admitted", "running", "preempting"})
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
RESYNC_MIN_INTERVAL_S = 1.0
DEFAULT_QUEUE = "default"  # where a job that names no queue goes, when the config has it
MISSING_GRACE_S = 5.0
MAX_CLUSTERS = 4096  # clusters known at once; a snapshot from one more is refused
RETIRED_INSTANCES = 16  # per cluster: batches from these old agent instances are replays


@dataclass(slots=True)
class AgentTrack:
    """What the broker knows about one cluster's agent connection."""

    instance: str | None = None
    seq: int = 0
    synced: bool = False  # a snapshot of the current instance has been applied
    last_heard: float = 0.0
    health: ClusterHealth = "healthy"
    last_resync: float = -1e18
    stale_s: float = 0.0  # the agent's cluster watches have been failing this long
    retired: list[str] = field(default_factory=list)  # earlier instances, newest last


@dataclass(slots=True)
class BatchOutcome:
    effects: list[Effect] = field(default_factory=list)
    error: str | None = None  # a rejected batch: the shell logs it; nothing changed
    applied: bool = False  # every event was applied: its outcomes may be acknowledged


class Machine:
    def __init__(
        self, config: BrokerConfig, scheduler: Scheduler | None = None, epoch: int = 0
    ) -> None:
        self.config = config
        self.scheduler = scheduler if scheduler is not None else Scheduler(config)
        self.epoch = epoch
        self.queues = {q.name: q for q in config.queues}
        self.jobs: dict[str, JobRecord] = {}
        self._demands: dict[str, tuple[PodSetDemand, ...]] = {}
        self._pending: dict[str, PendingQueue] = {q: PendingQueue() for q in self.queues}
        self._fresh: set[str] = set()
        self._capacity_dirty = True
        self._backoff: list[tuple[float, str]] = []
        self._live: set[str] = set()
        self._starting: set[str] = set()  # dispatched, not every replica running yet
        self._preempting: set[str] = set()
        self._spot_waiting: set[str] = set()  # queued spot-then-on-demand jobs still on spot
        self._spot_due: list[tuple[float, str]] = []  # (fallback time, job_id), lazily checked
        # job_id -> ((attempt, spot_exhausted, avoid count), valid until, request)
        self._requests: dict[str, tuple[tuple[int, bool, int], float, GangRequest]] = {}
        self._live_by_cluster: dict[str, set[str]] = {}
        self.reasons: dict[str, tuple[Reason, ...]] = {}
        self.agents: dict[str, AgentTrack] = {}
        self.flavors: dict[str, dict[str, FlavorInfo]] = {}
        self._order = 0
        t = config.timeouts
        lead = t.fence_lead_s
        self._fence_after = t.lost_after_s - lead if lead > 0 and t.lost_after_s > lead else 0.0
        self.lookahead = 256  # parked jobs per queue reconsidered when capacity frees
        # Resyncs asked of clusters that have not sent a snapshot yet (no track exists), so a
        # bare heartbeat under a made-up name costs a bounded entry here and nothing else.
        self._unknown_resync: dict[str, float] = {}
        self._truncated = False  # the last cycle left parked jobs beyond the lookahead
        self._truncated_queues: set[str] = set()
        self._recycle: set[str] = set()  # queues to look at again (see `schedule`)

    # ------------------------------------------------------------------ submission
    def submit(
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
        aliases = self.config.queue_aliases
        if subject_queue is not None:
            subject_queue = aliases.get(subject_queue, subject_queue)
        named = aliases.get(spec.queue, spec.queue) if spec.queue else None
        queue = named or subject_queue
        if named and subject_queue and named != subject_queue:
            return _reject(
                f"queue mismatch: the job names queue {spec.queue!r} but was published to "
                f"queue {subject_queue!r}; drop 'queue' from the job or publish to its subject"
            ), []
        if not queue and DEFAULT_QUEUE in self.queues:
            queue = DEFAULT_QUEUE  # as Kueue's LocalQueue defaulting does
        if not named and queue in (None, "", DEFAULT_QUEUE) and queue not in self.queues:
            known = ", ".join(sorted(self.queues)) or "(none)"
            return _reject(
                "the job names no queue and the config has no queue named "
                f"{DEFAULT_QUEUE!r} to take it; name one (--queue, `queue:`); known queues: {known}"
            ), []
        if queue not in self.queues:
            known = ", ".join(sorted(self.queues)) or "(none)"
            return _reject(f"unknown queue {queue!r}; known queues: {known}"), []
        if not spec.gang:
            return _reject("gang: the job has no podsets; give 'gang' or a supported manifest"), []
        if order is None:
            order = self._order + 1
        self._order = max(self._order, order)
        job_id = spec.job_id or derive_job_id(spec.name, id_token or str(order))
        existing = self.jobs.get(job_id)
        if existing is not None:
            return SubmitReply(accepted=True, job_id=job_id, duplicate=True), []
        cap = self.config.limits.max_pending_per_queue
        if cap and len(self._pending.get(queue, ())) >= cap:
            return _reject(
                f"queue {queue!r} is full: {cap} jobs are already pending "
                "(limits.max_pending_per_queue); retry later or submit to another queue"
            ), []
        demands = demands_of(spec)
        record = JobRecord(
            job_id=job_id, spec=spec, queue=queue, order=order, submitted_at=now, queued_at=now
        )
        problems = self.scheduler.check_feasible(gang_request(record, now, demands))
        if problems:
            text = "; ".join(r.message for r in problems)
            return _reject(f"the gang can never be placed: {text}"), []
        self.jobs[job_id] = record
        self._demands[job_id] = demands
        self._enqueue(record)
        return SubmitReply(accepted=True, job_id=job_id), [
            Persist(record),
            self._event(record, "queued", now),
        ]

    def cancel(self, job_id: str, reason: str, now: float) -> tuple[str | None, list[Effect]]:
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
    @property
    def wants_cycle(self) -> bool:
        return bool(self._fresh) or self._capacity_dirty or bool(self._recycle)

    def schedule(self, now: float) -> list[Effect]:
        """One admission cycle over the jobs that could have become admissible."""
        candidates = self._candidates(now)
        self._fresh.clear()
        self._capacity_dirty = False
        if not candidates:
            return []
        result = self.scheduler.schedule(candidates, now)
        if result.admitted and self._truncated:
            # Parked jobs beyond the lookahead wait behind the heads just admitted: keep
            # cycling while cycles make progress, or a deep backlog would wait for the next
            # capacity change. Only the queues that admitted get new heads; the others'
            # heads failed with at least as much capacity as is left now.
            admitted_queues = {self.jobs[job_id].queue for job_id, _ in result.admitted}
            self._recycle |= admitted_queues & self._truncated_queues
        effects: list[Effect] = []
        for job_id, placement in result.admitted:
            record = self.jobs[job_id]
            self._dequeue(record)
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
                self._fresh.add(job_id)
        return effects

    def _candidates(self, now: float) -> list[GangRequest]:
        touched: set[str] = set(self.queues) if self._capacity_dirty else set()
        touched |= self._recycle
        self._recycle = set()
        fresh_ok: list[str] = []
        for job_id in self._fresh:
            record = self.jobs.get(job_id)
            if record is None or record.state != "queued":
                continue
            if record.not_before > now:
                continue
            qconf = self.queues.get(record.queue)
            if qconf is None or qconf.strategy == "StrictFIFO":
                # A strict queue's head may block the new job. In a best-effort queue the
                # parked heads failed with at least the capacity left now (any increase
                # marks capacity dirty), so a cycle for new jobs needs only the new jobs.
                touched.add(record.queue)
            fresh_ok.append(job_id)
        chosen: dict[str, None] = {}
        self._truncated = False
        self._truncated_queues.clear()
        jobs = self.jobs

        def ready(job_id: str) -> bool:
            return jobs[job_id].not_before <= now

        for queue in touched:
            pending = self._pending.get(queue)
            if not pending:
                continue
            if len(pending) > self.lookahead:
                self._truncated = True
                self._truncated_queues.add(queue)
            for job_id in pending.heads(self.lookahead, ready):
                chosen[job_id] = None
        for job_id in fresh_ok:
            chosen[job_id] = None
        return [self._request(self.jobs[job_id], now) for job_id in chosen]

    def _request(self, record: JobRecord, now: float) -> GangRequest:
        """The job's GangRequest, rebuilt only when what it is made of changed: a parked job
        is reconsidered in many cycles, and building its request dominated their cost."""
        stamp = (record.attempt, record.spot_exhausted, len(record.avoid))
        hit = self._requests.get(record.job_id)
        if hit is not None and hit[0] == stamp and now < hit[1]:
            return hit[2]
        request = gang_request(record, now, self._demands[record.job_id])
        until = min((a.until for a in record.avoid if a.until > now), default=math.inf)
        self._requests[record.job_id] = (stamp, until, request)
        return request

    # ------------------------------------------------------------------ agents
    def on_batch(self, cluster: str, batch: EventBatch, now: float) -> BatchOutcome:
        out = BatchOutcome()
        if batch.cluster != cluster:
            out.error = (
                f"batch claims cluster {batch.cluster!r} but arrived on the subject of "
                f"cluster {cluster!r}; rejected"
            )
            return out
        events = batch.events
        track = self.agents.get(cluster)
        if track is not None and (
            batch.instance in track.retired
            or (batch.instance == track.instance and batch.seq <= track.seq)
        ):
            out.error = (
                f"batch {batch.seq} of agent instance {batch.instance!r} of cluster {cluster!r} "
                "is older than one already applied (a replay); ignored"
            )
            return out
        in_sequence = (
            track is not None
            and track.instance == batch.instance
            and track.synced
            and batch.seq == track.seq + 1
        )
        # Only a batch out of sequence needs its snapshot found (the common case skips the scan).
        snap_at = (
            None
            if in_sequence
            else next((i for i, e in enumerate(events) if isinstance(e, ClusterSnapshot)), None)
        )
        if track is None:
            if snap_at is None:
                # Clusters exist only from a snapshot: ask for one, remember nothing else.
                self._resync_unknown(cluster, now, out)
                return out
            if len(self.agents) >= MAX_CLUSTERS:
                out.error = f"cluster {cluster!r} refused: {MAX_CLUSTERS} clusters already known"
                return out
            self._unknown_resync.pop(cluster, None)
            track = self.agents[cluster] = AgentTrack(last_heard=now)
        was = track.health
        track.last_heard = now
        start = 0
        if not in_sequence:
            if snap_at is None:
                self._retire(track, batch.instance)
                track.instance = batch.instance
                track.seq = batch.seq
                track.synced = False
                self._resync(cluster, track, now, "sequence gap or unknown agent", out.effects)
                return out
            start = snap_at
        self._retire(track, batch.instance)
        track.instance = batch.instance
        track.seq = batch.seq
        out.applied = True
        if was != "healthy":
            track.health = "healthy"
            self.scheduler.set_cluster_schedulable(cluster, True)
            self._capacity_dirty = True
        for event in events[start:]:
            self._apply(cluster, track, event, now, out.effects)
        return out

    @staticmethod
    def _retire(track: AgentTrack, instance: str) -> None:
        """A new agent instance replaces the current one, which may never speak again."""
        old = track.instance
        if old is not None and old != instance and old not in track.retired:
            track.retired.append(old)
            del track.retired[:-RETIRED_INSTANCES]

    def _resync_unknown(self, cluster: str, now: float, out: BatchOutcome) -> None:
        asked = self._unknown_resync
        if now - asked.get(cluster, -1e18) < RESYNC_MIN_INTERVAL_S:
            return
        if len(asked) >= MAX_CLUSTERS:
            stale = [c for c, t in asked.items() if now - t >= RESYNC_MIN_INTERVAL_S]
            for c in stale:
                del asked[c]
            if len(asked) >= MAX_CLUSTERS:
                return
        asked[cluster] = now
        out.effects.append(Send(cluster, Resync(epoch=self.epoch, reason="unknown agent")))

    def _resync(
        self, cluster: str, track: AgentTrack, now: float, why: str, effects: list[Effect]
    ) -> None:
        if now - track.last_resync < RESYNC_MIN_INTERVAL_S:
            return
        track.last_resync = now
        effects.append(Send(cluster, Resync(epoch=self.epoch, reason=why)))

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
                self._capacity_dirty = True
            track.stale_s = event.stale_s
            return
        if isinstance(event, ClusterSnapshot):
            self._snapshot(cluster, track, event, now, effects)
        elif isinstance(event, WorkloadStatus):
            self._workload(cluster, event, now, effects)
        elif isinstance(event, CheckpointReport):
            self.on_checkpoint(event, now, effects, cluster=cluster)
        elif isinstance(event, SpotNotice):
            for job_id in self.scheduler.spot_notice(cluster, event.node, event.deadline, now):
                self._spot(job_id, cluster, event, now, effects)
            self._capacity_dirty = True
        elif isinstance(event, NodeUpsert):
            lost = self.scheduler.upsert_node(cluster, event.node, now)
            self._lose_all(
                lost, "node-unusable", now, effects, cluster=cluster, node=event.node.name
            )
            self._capacity_dirty = True
        elif isinstance(event, NodeGone):
            lost = self.scheduler.remove_node(cluster, event.node, now)
            self._lose_all(lost, "node-lost", now, effects, cluster=cluster, node=event.node)
            self._capacity_dirty = True
        elif isinstance(event, GpuHealth):
            lost = self.scheduler.set_gpu_health(cluster, event.node, event.healthy, now)
            cause = f"gpu-failure (xid {event.xid})" if event.xid is not None else "gpu-failure"
            self._lose_all(lost, cause, now, effects, cluster=cluster, node=event.node)
            self._capacity_dirty = True

    def _snapshot(
        self,
        cluster: str,
        track: AgentTrack,
        snap: ClusterSnapshot,
        now: float,
        effects: list[Effect],
    ) -> None:
        self.flavors[cluster] = {f.name: f for f in snap.flavors}
        lost = self.scheduler.apply_snapshot(cluster, snap.flavors, snap.nodes, now)
        track.synced = True
        self._lose_all(lost, "node-lost", now, effects, cluster=cluster)
        reported: set[tuple[str, int]] = set()
        for status in snap.workloads:
            reported.add((status.job_id, status.attempt))
            self._workload(cluster, status, now, effects, snapshot=True)
        for job_id in list(self._live_by_cluster.get(cluster, ())):
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
        self._capacity_dirty = True

    def _workload(
        self,
        cluster: str,
        status: WorkloadStatus,
        now: float,
        effects: list[Effect],
        *,
        snapshot: bool = False,
    ) -> None:
        record = self.jobs.get(status.job_id)
        current = record.current if record is not None else None
        if (
            record is None
            or current is None
            or current.attempt != status.attempt
            or current.cluster != cluster
        ):
            if record is not None and status.phase == "succeeded":
                self._late_success(record, cluster, status, now, effects)
                return
            if status.phase in ("created", "running"):
                # A copy the broker does not consider live: fence it off.
                effects.append(
                    Send(
                        cluster,
                        Cancel(
                            job_id=status.job_id,
                            epoch=self.epoch,
                            attempt=status.attempt,
                            reason="stale attempt: not the job's live attempt",
                        ),
                    )
                )
            return
        phase = status.phase
        if phase == "running":
            if (
                status.running_replicas >= max(status.total_replicas, 1)
                and current.running_at is None
            ):
                current.running_at = now
                record.start_failures = 0
                if record.state == "admitted":
                    record.state = "running"
                self.scheduler.note_progress(record.job_id, current.attempt, now)
                effects.append(Persist(record))
                effects.append(self._event(record, "running", now))
            elif current.running_at is not None and status.reason and not snapshot:
                # Running again with a note: replicas restarted in place (a crash loop shows
                # before the operator gives up). Nothing changes but what users are told; a
                # snapshot repeats the note of an old restart, so it says nothing.
                effects.append(self._event(record, "restarted", now, reason=status.reason))
        elif phase == "succeeded":
            self._finish(record, "succeeded", now, status.reason or None, effects)
        elif phase == "failed":
            self._failed(record, status, now, effects)
        elif phase == "evicted":
            self._lose(record, status.reason or "evicted", now, effects)

    def _late_success(
        self,
        record: JobRecord,
        cluster: str,
        status: WorkloadStatus,
        now: float,
        effects: list[Effect],
    ) -> None:
        """An attempt the broker gave up on (its cluster was declared lost, or a preemption
        ended it) finished after all: the job's work is done. Running it again would complete
        it twice, so the job ends succeeded and any newer attempt is cancelled."""
        if record.state in TERMINAL:
            return
        old = next(
            (a for a in record.attempts if a.attempt == status.attempt and a.cluster == cluster),
            None,
        )
        if old is None or old.live:
            return
        newer = record.current
        if newer is not None:
            self._end_attempt(
                record, newer, "superseded: an earlier attempt succeeded", now, lost=True
            )
            effects.append(
                Send(
                    newer.cluster,
                    self._cancel_cmd(record.job_id, newer.attempt, "an earlier attempt succeeded"),
                )
            )
        old.end_cause = "succeeded"
        old.gpu_seconds_lost = 0.0  # its work was not lost after all
        reason = f"attempt {old.attempt} on {cluster} succeeded after it was given up"
        self._finish(record, "succeeded", now, reason, effects)

    # ------------------------------------------------------------------ checkpoints
    def on_checkpoint(
        self,
        report: CheckpointReport,
        now: float,
        effects: list[Effect],
        *,
        cluster: str | None = None,
    ) -> None:
        """A checkpoint from the agent (`cluster`: whose batch carried it) or from the
        workload's SDK; fenced by attempt, and refused when it could not be genuine."""
        record = self.jobs.get(report.job_id)
        if record is None:
            return
        current = record.current
        if current is None or current.attempt != report.attempt:
            return
        reason = _checkpoint_doubt(record, current, report, now, cluster)
        if reason:
            effects.append(
                self._event(record, "checkpoint-refused", now, step=report.step, reason=reason)
            )
            return
        latest = record.latest_checkpoint
        if latest is None or report.step > latest.step:
            record.latest_checkpoint = LatestCheckpoint(
                step=report.step, uri=report.uri, at=now, attempt=report.attempt
            )
            self.scheduler.note_progress(record.job_id, current.attempt, now)
            effects.append(Persist(record))
            effects.append(self._event(record, "checkpointed", now, step=report.step))
        pre = record.preempting
        if pre is not None and (pre.step_at_start is None or report.step > pre.step_at_start):
            self._finish_preempt(record, now, effects)

    def checkpoint(self, report: CheckpointReport, now: float) -> list[Effect]:
        effects: list[Effect] = []
        self.on_checkpoint(report, now, effects)
        return effects

    # ------------------------------------------------------------------ dispatch results
    def on_dispatch_result(
        self, job_id: str, attempt: int, ok: bool, error: str, now: float
    ) -> list[Effect]:
        record = self.jobs.get(job_id)
        if record is None:
            return []
        current = record.current
        if current is None or current.attempt != attempt:
            return []
        if ok:
            if current.acked_at is not None:
                return []
            # Persisted: after a restart, a dispatch without it is sent again.
            current.acked_at = now
            return [Persist(record)]
        effects: list[Effect] = []
        record.start_failures += 1
        self._end_attempt(record, current, f"dispatch-failed: {error}", now, lost=True)
        effects.append(Send(current.cluster, self._cancel_cmd(job_id, attempt, "dispatch failed")))
        self._requeue(
            record,
            now,
            self._backoff_delay(record, record.start_failures),
            effects,
            reason=f"dispatch failed on {current.cluster}: {error}",
        )
        return effects

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        timeouts = self.config.timeouts
        for cluster, track in list(self.agents.items()):
            silent = now - track.last_heard
            if silent > timeouts.lost_after_s and track.health != "lost":
                track.health = "lost"
                track.synced = False
                track.instance = None
                jobs = set(self.scheduler.remove_cluster(cluster, now))
                jobs |= self._live_by_cluster.get(cluster, set())
                self._lose_all(sorted(jobs), "cluster-lost", now, effects, cluster=cluster)
                self._capacity_dirty = True
            elif silent > timeouts.unreachable_after_s and track.health == "healthy":
                track.health = "unreachable"
                self.scheduler.set_cluster_schedulable(cluster, False)
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
                delay = self._backoff_delay(record, record.start_failures)
                self._requeue(
                    record, now, delay, effects, reason=f"not all replicas ran within {limit:g}s"
                )
        while self._backoff and self._backoff[0][0] <= now:
            _, job_id = heapq.heappop(self._backoff)
            waiting = self.jobs.get(job_id)
            if waiting is not None and waiting.state == "queued":
                self._fresh.add(job_id)
        while self._spot_due and self._spot_due[0][0] < now:
            due, job_id = heapq.heappop(self._spot_due)
            record = self.jobs[job_id]
            if job_id not in self._spot_waiting:
                continue
            if record.state != "queued" or record.spot_exhausted:
                self._spot_waiting.discard(job_id)
            elif now - record.queued_at > record.spec.spot.fallback_after_wait_s:
                record.spot_exhausted = True
                self._spot_waiting.discard(job_id)
                self._fresh.add(job_id)
            else:  # requeued since: wait from the newer queued_at
                again = record.queued_at + record.spec.spot.fallback_after_wait_s
                heapq.heappush(self._spot_due, (max(again, due), job_id))
        return effects

    # ------------------------------------------------------------------ recovery after restart
    def restore(self, records: Iterable[JobRecord], now: float) -> None:
        """Rebuild from persisted records. Live attempts are assumed to hold their placement
        until their agents resend snapshots (or their clusters are declared lost)."""
        for record in records:
            self.jobs[record.job_id] = record
            self._demands[record.job_id] = demands_of(record.spec)
            self._order = max(self._order, record.order)
            if record.state in TERMINAL:
                continue
            if record.queue not in self.queues:
                self._pending.setdefault(record.queue, PendingQueue())
            if record.state == "queued":
                self._enqueue(record)
                continue
            current = record.current
            if current is None:
                record.state = "queued"
                self._enqueue(record)
                continue
            request = gang_request(record, now, self._demands[record.job_id])
            request.attempt = current.attempt
            self.scheduler.assume(request, _placement_of(current))
            self._track_live(record, current.cluster)
            if current.running_at is None:
                self._starting.add(record.job_id)
            if record.preempting is not None:
                self._preempting.add(record.job_id)
            if record.preempting is not None and record.preempting.replacement is not None:
                rep = record.preempting.replacement
                request.attempt = rep.attempt
                self.scheduler.assume(request, _placement_of(rep))
            self.scheduler.note_progress(
                record.job_id,
                current.attempt,
                record.latest_checkpoint.at if record.latest_checkpoint else current.dispatched_at,
            )
            if current.cluster not in self.agents:
                self.agents[current.cluster] = AgentTrack(last_heard=now)
        # Restored queued jobs count as parked, not fresh: each was tried before the restart
        # (or is as good as a parked one), and no cluster has reported yet. The first cycle then
        # takes the `lookahead` heads of each queue, not all 100,000 jobs at once, which would
        # keep a just-restarted broker deaf for seconds.
        self._fresh.clear()
        self._capacity_dirty = True

    # ------------------------------------------------------------------ internals
    def _attempt_for(self, record: JobRecord, placement: Placement, now: float) -> AttemptRecord:
        flavor = self.flavors.get(placement.cluster, {}).get(placement.flavor)
        return AttemptRecord(
            attempt=record.attempt + 1,
            cluster=placement.cluster,
            flavor=placement.flavor,
            flavor_class=placement.flavor_class,
            assignment=[PodSetAssignment(podset=p, nodes=list(n)) for p, n in placement.assignment],
            dispatched_at=now,
            capacity_type=flavor.capacity_type if flavor else "",
            gpu_type=flavor.gpu_type if flavor else "",
            price_per_gpu_hour=flavor.price_per_gpu_hour if flavor else 0.0,
        )

    def _dispatch(
        self,
        record: JobRecord,
        attempt: AttemptRecord,
        now: float,
        effects: list[Effect],
        note: str | None = None,  # the admitted event's reason (a partial admission's note)
    ) -> None:
        attempt.dispatched_at = now
        attempt.resume_from = record.resume_point()
        record.attempt = attempt.attempt
        record.attempts.append(attempt)
        record.state = "admitted"
        record.reason = None
        self._track_live(record, attempt.cluster)
        self._starting.add(record.job_id)
        effects.append(Persist(record))
        effects.append(Send(attempt.cluster, self._dispatch_cmd(record, attempt)))
        effects.append(
            self._event(
                record,
                "admitted",
                now,
                reason=note,
                resume_from_step=attempt.resume_from.step if attempt.resume_from else None,
            )
        )

    def _dispatch_cmd(self, record: JobRecord, attempt: AttemptRecord) -> Dispatch:
        spec = record.spec
        return Dispatch(
            job_id=record.job_id,
            attempt=attempt.attempt,
            epoch=self.epoch,
            flavor=attempt.flavor,
            assignment=attempt.assignment,
            spec=spec,
            resume_from=attempt.resume_from,
            checkpoint_uri=spec.checkpoint.uri if spec.checkpoint else "",
            fence_after_s=self._fence_after,
        )

    def resend_unacknowledged(self, now: float) -> list[Effect]:
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
            effects.append(Send(current.cluster, self._dispatch_cmd(record, current)))
        return effects

    def _spot(
        self, job_id: str, cluster: str, notice: SpotNotice, now: float, effects: list[Effect]
    ) -> None:
        record = self.jobs.get(job_id)
        if record is None:
            return
        pre = record.preempting
        if pre is not None:
            rep = pre.replacement
            if rep is not None and rep.cluster == cluster and notice.node in _nodes(rep):
                # The reserved replacement is itself being reclaimed: reserve again elsewhere.
                self.scheduler.release(job_id, rep.attempt)
                pre.replacement = None
                self._reserve_replacement(record, now)
                effects.append(Persist(record))
            return
        if record.state not in ("admitted", "running"):
            return
        current = record.current
        if current is None or current.cluster != cluster:
            return
        self._begin_preempt(record, "spot-notice", notice.deadline, now, effects, reserve=True)

    def _reserve_replacement(self, record: JobRecord, now: float) -> None:
        """Make-before-break: hold a placement for the next attempt away from the lost pool."""
        current = record.current
        pre = record.preempting
        if current is None or pre is None:
            return
        request = gang_request(record, now, self._demands[record.job_id])
        request.avoid_pools = request.avoid_pools | {(current.cluster, current.flavor)}
        if self._spot_fallback_due(record, extra=1):
            request.spot_exhausted = True
        got = self.scheduler.reserve(request, now, replacing_attempt=current.attempt)
        if isinstance(got, Placement):
            pre.replacement = self._attempt_for(record, got, now)

    def _begin_preempt(
        self,
        record: JobRecord,
        cause: str,
        deadline: float,
        now: float,
        effects: list[Effect],
        *,
        reserve: bool,
    ) -> None:
        current = record.current
        if current is None or record.preempting is not None:
            return
        latest = record.latest_checkpoint
        record.preempting = Preempting(
            cause=cause,
            deadline=deadline,
            started_at=now,
            step_at_start=latest.step if latest is not None else None,
        )
        record.state = "preempting"
        self._preempting.add(record.job_id)
        if reserve:
            self._reserve_replacement(record, now)
        effects.append(Persist(record))
        effects.append(self._event(record, "preempting", now, reason=cause))
        if record.spec.checkpoint is None or current.running_at is None:
            # Nothing to wait for: no checkpoints are written, or the gang never ran.
            self._finish_preempt(record, now, effects)
            return
        effects.append(
            Send(
                current.cluster,
                CheckpointNow(
                    job_id=record.job_id,
                    attempt=current.attempt,
                    epoch=self.epoch,
                    deadline=deadline,
                ),
            )
        )

    def _finish_preempt(self, record: JobRecord, now: float, effects: list[Effect]) -> None:
        pre = record.preempting
        if pre is None:
            return
        record.preempting = None
        self._preempting.discard(record.job_id)
        current = record.current
        if current is not None:
            self._end_attempt(record, current, pre.cause, now, lost=True)
            effects.append(
                Send(current.cluster, self._cancel_cmd(record.job_id, current.attempt, pre.cause))
            )
            if pre.cause == "spot-notice":
                record.avoid.append(
                    AvoidPool(
                        current.cluster,
                        current.flavor,
                        now + self.config.scheduling.avoid_lost_pool_s,
                    )
                )
        if self._charge_preemption(record, current, now, pre.cause, effects):
            if pre.replacement is not None:
                self.scheduler.release(record.job_id, pre.replacement.attempt)
            return
        if pre.replacement is not None:
            self._dispatch(record, pre.replacement, now, effects)
        else:
            self._requeue(record, now, 0.0, effects, reason=pre.cause)

    def _lose_all(
        self,
        job_ids: Sequence[str],
        cause: str,
        now: float,
        effects: list[Effect],
        *,
        cluster: str,
        node: str | None = None,
    ) -> None:
        for job_id in job_ids:
            record = self.jobs.get(job_id)
            if record is None or record.state not in LIVE_STATES:
                continue
            pre = record.preempting
            if pre is not None and pre.replacement is not None:
                rep = pre.replacement
                if rep.cluster == cluster and (node is None or node in _nodes(rep)):
                    # The reserved replacement lost its capacity: fall back to the queue.
                    self.scheduler.release(job_id, rep.attempt)
                    pre.replacement = None
            current = record.current
            if current is None or current.cluster != cluster:
                continue
            if node is not None and node not in _nodes(current):
                continue
            self._lose(record, cause, now, effects)

    def _lose(self, record: JobRecord, cause: str, now: float, effects: list[Effect]) -> None:
        """The live attempt is gone without warning (node, GPU, cluster, eviction)."""
        current = record.current
        if current is None:
            return
        if record.preempting is not None:
            self._finish_preempt(record, now, effects)
            return
        self._end_attempt(record, current, cause, now, lost=True)
        effects.append(
            Send(current.cluster, self._cancel_cmd(record.job_id, current.attempt, cause))
        )
        record.avoid.append(
            AvoidPool(
                current.cluster, current.flavor, now + self.config.scheduling.avoid_lost_pool_s
            )
        )
        if self._charge_preemption(record, current, now, cause, effects):
            return
        self._requeue(record, now, 0.0, effects, reason=cause)

    def _charge_preemption(
        self,
        record: JobRecord,
        attempt: AttemptRecord | None,
        now: float,
        cause: str,
        effects: list[Effect],
    ) -> bool:
        """Count an infrastructure loss; True when the budget is spent and the job failed."""
        record.preemptions += 1
        if attempt is not None and attempt.capacity_type == "spot":
            record.spot_preemptions += 1
        if self._spot_fallback_due(record):
            record.spot_exhausted = True
        verdict = no_progress_verdict(record)
        if verdict == "fall-back":
            record.spot_exhausted = True
        elif verdict == "fail":
            self._finish(record, "failed", now, no_progress_reason(record), effects)
            return True
        limit = record.spec.restart.max_preemptions
        if limit is not None and record.preemptions > limit:
            self._finish(
                record,
                "failed",
                now,
                f"preemption budget spent: {record.preemptions} losses "
                f"(restart.max_preemptions={limit}); last cause: {cause}",
                effects,
            )
            return True
        return False

    def _spot_fallback_due(self, record: JobRecord, extra: int = 0) -> bool:
        spec = record.spec
        return (
            spec.capacity == "spot-then-on-demand"
            and record.spot_preemptions + extra >= spec.spot.fallback_after_preemptions
        )

    def _failed(
        self, record: JobRecord, status: WorkloadStatus, now: float, effects: list[Effect]
    ) -> None:
        if record.preempting is not None:
            self._finish_preempt(record, now, effects)
            return
        policy = record.spec.restart
        codes = [c for c in status.exit_codes if c != 0]
        detail = f"exit codes {codes}" + (f": {status.reason}" if status.reason else "")
        if policy.retriable_exit_codes and not any(c in policy.retriable_exit_codes for c in codes):
            self._finish(
                record,
                "failed",
                now,
                f"{detail}; not in restart.retriable_exit_codes {policy.retriable_exit_codes}",
                effects,
            )
            return
        record.errors += 1
        if record.errors > policy.max_restarts_on_error:
            self._finish(
                record,
                "failed",
                now,
                f"error budget spent: {record.errors} failures "
                f"(restart.max_restarts_on_error={policy.max_restarts_on_error}); last: {detail}",
                effects,
            )
            return
        current = record.current
        if current is not None:
            self._end_attempt(record, current, f"error: {detail}", now, lost=True)
        self._requeue(
            record, now, self._backoff_delay(record, record.errors), effects, reason=detail
        )

    def _finish(
        self,
        record: JobRecord,
        state: JobState,
        now: float,
        reason: str | None,
        effects: list[Effect],
    ) -> None:
        current = record.current
        if current is not None:
            self._end_attempt(record, current, state, now, lost=state != "succeeded")
            if state != "succeeded":
                effects.append(
                    Send(current.cluster, self._cancel_cmd(record.job_id, current.attempt, state))
                )
        pre = record.preempting
        if pre is not None and pre.replacement is not None:
            self.scheduler.release(record.job_id, pre.replacement.attempt)
        record.preempting = None
        self._dequeue(record)
        self.reasons.pop(record.job_id, None)
        self._requests.pop(record.job_id, None)
        record.state = state
        record.reason = reason
        record.finished_at = now
        effects.append(Persist(record))
        event = self._event(record, state, now, reason=reason)
        view = self.job_view(record.job_id, now, with_spec=False)
        if view is not None:
            event.event.accounting = view.accounting
        effects.append(event)

    def _end_attempt(
        self, record: JobRecord, attempt: AttemptRecord, cause: str, now: float, *, lost: bool
    ) -> None:
        attempt.ended_at = now
        attempt.end_cause = cause
        gpus = record.total_gpus
        held = max(0.0, now - attempt.dispatched_at)
        attempt.gpu_seconds = held * gpus
        if lost:
            since = attempt.running_at if attempt.running_at is not None else attempt.dispatched_at
            ckpt = record.latest_checkpoint
            if ckpt is not None and ckpt.attempt == attempt.attempt:
                since = max(since, ckpt.at)
            attempt.gpu_seconds_lost = max(0.0, now - since) * gpus
            if attempt.running_at is not None:
                # Start-up time before the gang ran is lost too.
                attempt.gpu_seconds_lost += (attempt.running_at - attempt.dispatched_at) * gpus
            else:
                attempt.gpu_seconds_lost = attempt.gpu_seconds
        attempt.cost = attempt.gpu_seconds / 3600.0 * attempt.price_per_gpu_hour
        self.scheduler.release(record.job_id, attempt.attempt)
        self._untrack_live(record, attempt.cluster)
        self._capacity_dirty = True

    def _requeue(
        self, record: JobRecord, now: float, delay: float, effects: list[Effect], *, reason: str
    ) -> None:
        record.state = "queued"
        record.reason = reason
        record.preempting = None
        record.queued_at = now
        record.not_before = now + delay
        self._enqueue(record)
        if delay > 0:
            heapq.heappush(self._backoff, (record.not_before, record.job_id))
        effects.append(Persist(record))
        effects.append(self._event(record, "requeued", now, reason=reason))

    def _backoff_delay(self, record: JobRecord, failures: int) -> float:
        policy = record.spec.restart
        return float(min(policy.backoff_s * 2 ** max(0, failures - 1), policy.max_backoff_s))

    def _enqueue(self, record: JobRecord) -> None:
        self._pending.setdefault(record.queue, PendingQueue()).add(
            record.job_id, record.spec.priority, record.order
        )
        self._fresh.add(record.job_id)
        if record.spec.capacity == "spot-then-on-demand" and not record.spot_exhausted:
            self._spot_waiting.add(record.job_id)
            due = record.queued_at + record.spec.spot.fallback_after_wait_s
            heapq.heappush(self._spot_due, (due, record.job_id))

    def _dequeue(self, record: JobRecord) -> None:
        pending = self._pending.get(record.queue)
        if pending is not None:
            pending.discard(record.job_id)
        self._fresh.discard(record.job_id)
        self._spot_waiting.discard(record.job_id)

    def _track_live(self, record: JobRecord, cluster: str) -> None:
        self._live.add(record.job_id)
        self._live_by_cluster.setdefault(cluster, set()).add(record.job_id)

    def _untrack_live(self, record: JobRecord, cluster: str) -> None:
        self._live.discard(record.job_id)
        self._starting.discard(record.job_id)
        jobs = self._live_by_cluster.get(cluster)
        if jobs is not None:
            jobs.discard(record.job_id)

    def _cancel_cmd(self, job_id: str, attempt: int, reason: str) -> Cancel:
        return Cancel(job_id=job_id, epoch=self.epoch, attempt=attempt, reason=reason)

    def _event(
        self,
        record: JobRecord,
        kind: EventKind,
        now: float,
        *,
        reason: str | None = None,
        step: int | None = None,
        resume_from_step: int | None = None,
    ) -> Publish:
        attempt = record.attempts[-1] if record.attempts else None
        return Publish(
            JobEvent(
                job_id=record.job_id,
                kind=kind,
                at=now,
                state=record.state,
                attempt=record.attempt,
                cluster=attempt.cluster if attempt else None,
                flavor=attempt.flavor if attempt else None,
                reason=reason,
                step=step,
                resume_from_step=resume_from_step,
            )
        )

    # ------------------------------------------------------------------ views
    def job_view(self, job_id: str, now: float, *, with_spec: bool = True) -> JobView | None:
        record = self.jobs.get(job_id)
        if record is None:
            return None
        attempts = [_attempt_view(a, record.total_gpus, now) for a in record.attempts]
        used = sum(a.gpu_seconds for a in attempts)
        lost = sum(a.gpu_seconds_lost for a in attempts)
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
            latest_checkpoint=CheckpointView(
                step=ckpt.step, uri=ckpt.uri, at=ckpt.at, attempt=ckpt.attempt
            )
            if ckpt
            else None,
            attempts=attempts,
            accounting=Accounting(
                attempts=len(record.attempts),
                preemptions=record.preemptions,
                errors=record.errors,
                gpu_seconds_used=used,
                gpu_seconds_lost=lost,
                goodput=(used - lost) / used if used > 0 else 1.0,
                cost=sum(a.cost for a in attempts),
            ),
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
        for record in _matching(self.jobs.values(), queue, state, cluster, None):
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
        for record in _matching(reversed(self.jobs.values()), queue, state, cluster, name):
            if offset <= total < end:
                page.append(record.job_id)
            total += 1
        views = [self.job_view(j, now, with_spec=False) for j in page]
        return total, [v for v in views if v is not None]

    def first_reason(self, job_id: str) -> str | None:
        """The scheduler's first reason for a queued job (what `muster status` shows)."""
        reasons = self.reasons.get(job_id)
        return reasons[0].message if reasons else None

    def oldest_pending(self) -> dict[str, float]:
        """Per queue, when its longest-waiting pending job was submitted."""
        out: dict[str, float] = {}
        for queue, ids in self._pending.items():
            if ids:
                out[queue] = min(self.jobs[j].submitted_at for j in ids)
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
            reasons.extend(pending_reason(r) for r in self.reasons.get(record.job_id, ()))
        elif record.state == "preempting" and record.preempting is not None:
            reasons.append(
                PendingReason(
                    code="preempting",
                    message=f"{record.preempting.cause}: waiting for a checkpoint until "
                    f"{record.preempting.deadline:.0f}",
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

    def why(self, job_id: str, now: float) -> WhyView | None:
        record = self.jobs.get(job_id)
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
            pending = self._pending.get(record.queue)
            position = pending.rank(job_id) if pending is not None else 0
            demands = self._demands.get(job_id) or demands_of(record.spec)
            request = gang_request(record, now, demands)
            candidates = [pending_reason(r) for r in self.scheduler.pool_reasons(request)]
            waiting_for = _waiting_for(reasons, candidates)
        elif record.state == "preempting":
            waiting_for = "checkpoint"
        return WhyView(
            job_id=job_id,
            state=record.state,
            reasons=reasons,
            position=position,
            queue=record.queue,
            waiting_for=waiting_for,
            candidates=candidates,
        )

    def queue_views(self) -> list[QueueView]:
        counts = {q: len(p) for q, p in self._pending.items()}
        return self.scheduler.queue_views(counts)

    def cluster_views(self, now: float) -> list[ClusterView]:
        names = sorted(set(self.agents) | set(self.scheduler.known_clusters()))
        out = []
        for name in names:
            track = self.agents.get(name)
            out.append(
                ClusterView(
                    name=name,
                    health=track.health if track else "lost",
                    last_heartbeat=track.last_heard if track else None,
                    flavors=self.scheduler.flavor_views(name, now),
                    running_jobs=len(self._live_by_cluster.get(name, ())),
                    stale_s=track.stale_s if track else 0.0,
                )
            )
        return out

    def pending_count(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def live_count(self) -> int:
        return len(self._live)


_WAIT_FOR = {
    "backoff": "backoff",
    "waiting-for-preemption": "capacity (victims are being preempted)",
    "strict-fifo-blocked": "the head of its StrictFIFO queue",
    "max-admissions": "the next cycle",
    "no-clusters": "a cluster to report",
}


def _waiting_for(reasons: list[PendingReason], candidates: list[PendingReason]) -> str:
    """One phrase: what must change for the job to start."""
    for r in reasons:
        if r.code in _WAIT_FOR:
            return _WAIT_FOR[r.code]
    codes = {c.code for c in candidates}
    if "fits-now" in codes:
        return "the next cycle"
    if "spot-first" in codes or "insufficient-capacity" in codes:
        return "capacity"
    if "quota-exceeded" in codes:
        return "quota"
    if "pool-avoided" in codes or "cluster-unhealthy" in codes:
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


def _reject(error: str) -> SubmitReply:
    return SubmitReply(accepted=False, error=error)


def derive_job_id(name: str, token: str) -> str:
    """The id of a job submitted without one: its name and a token, at most 63 characters."""
    suffix = f"-{token}"
    return name[: 63 - len(suffix)].rstrip("-") + suffix


def _nodes(attempt: AttemptRecord) -> set[str]:
    return {n for a in attempt.assignment for n in a.nodes}


def _placement_of(attempt: AttemptRecord) -> Placement:
    return Placement(
        cluster=attempt.cluster,
        flavor=attempt.flavor,
        flavor_class=attempt.flavor_class,
        assignment=tuple((a.podset, tuple(a.nodes)) for a in attempt.assignment),
    )


def _attempt_view(attempt: AttemptRecord, gpus: int, now: float) -> AttemptView:
    gpu_seconds = attempt.gpu_seconds
    cost = attempt.cost
    if attempt.ended_at is None:
        gpu_seconds = max(0.0, now - attempt.dispatched_at) * gpus
        cost = gpu_seconds / 3600.0 * attempt.price_per_gpu_hour
    return AttemptView(
        attempt=attempt.attempt,
        cluster=attempt.cluster,
        flavor=attempt.flavor,
        capacity_type=attempt.capacity_type,
        gpu_type=attempt.gpu_type,
        dispatched_at=attempt.dispatched_at,
        running_at=attempt.running_at,
        ended_at=attempt.ended_at,
        end_cause=attempt.end_cause,
        resume_from_step=attempt.resume_from.step if attempt.resume_from else None,
        gpu_seconds=gpu_seconds,
        gpu_seconds_lost=attempt.gpu_seconds_lost,
        cost=cost,
    )


def uri_under(uri: str, location: str) -> bool:
    """`uri` is `location` or below it (path-segment boundary), so one job cannot report a
    checkpoint inside another job's location."""
    base = location.rstrip("/")
    return uri == base or uri.startswith(base + "/")


def _checkpoint_doubt(
    record: JobRecord,
    current: AttemptRecord,
    report: CheckpointReport,
    now: float,
    cluster: str | None,
) -> str | None:
    """Why a checkpoint report cannot be genuine, or None: one agent must not speak for an
    attempt on another cluster, nor any reporter move a job's progress backwards or further
    than its declared pace allows (a forged step would make the job skip its work)."""
    if cluster is not None and cluster != current.cluster:
        return (
            f"cluster {cluster!r} reported a checkpoint for attempt {current.attempt}, which "
            f"runs on {current.cluster!r}; only that cluster's agent may report it"
        )
    ckpt = record.spec.checkpoint
    location = ckpt.uri if ckpt else ""
    if location and not uri_under(report.uri, location):
        return (
            f"checkpoint {report.uri!r} is not under the job's checkpoint "
            f"location {location!r}; write checkpoints below it"
        )
    latest = record.latest_checkpoint
    if latest is not None and report.step < latest.step:
        return (
            f"step {report.step} is behind the latest checkpoint (step {latest.step}); "
            "progress reports must not go backwards"
        )
    pace = ckpt.max_steps_per_s if ckpt else None
    if pace is not None:
        base = current.resume_from.step if current.resume_from else 0
        since = current.running_at if current.running_at is not None else current.dispatched_at
        reachable = base + pace * max(0.0, now - since)
        if report.step > reachable:
            return (
                f"step {report.step} is beyond what attempt {current.attempt} could reach: "
                f"{base} + {pace:g} steps/s x {max(0.0, now - since):.0f}s = {reachable:.0f} "
                "(checkpoint.max_steps_per_s); raise it if the job really runs faster"
            )
    return None
