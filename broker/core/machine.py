"""The job lifecycle machine: sans-IO, in the manner of h11.

The shell feeds it one typed input at a time (`broker.core.inputs`) together with `now`, and
carries out the effects it returns, in order (`Machine.handle`). `Machine` is the one entry
point; behind it each fact has one owner:

- `registry.JobRegistry`: which jobs exist, their gangs, and why queued ones wait;
- `submission`: which queue a job goes to and why it is refused (pure);
- `agents.AgentTracker`: which agent batches to apply (instance, sequence, resync), cluster
  health;
- `backlog.Backlog`: the pending queues, what an admission cycle looks at and when, and each
  queued job's cached request;
- `lifecycle.AttemptLifecycle`: the attempt lifecycle (dispatch to finish) and which jobs are
  live where;
- `moves.PlannedMoves`: moves by choice (deadline switch, return to spot) and their scan
  state;
- `accounting`: GPU-seconds, lost work and cost (pure);
- `views.JobViews`: read-only queries for the API and the dashboard (`Machine.views`).

The `Scheduler` owns capacity, flavors and quota; the machine asks it. The machine itself
keeps only the submission order and routes each input to the components.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import assert_never, get_args

from broker.core.agents import AgentTrack, AgentTracker
from broker.core.backlog import Backlog
from broker.core.effects import BatchApplied, Effect, Forget, Persist, Refused, Send, Submitted
from broker.core.elastic import queued_top
from broker.core.inputs import (
    AgentBatch,
    CancelJob,
    CancelSettled,
    Checkpoint,
    Cycle,
    DispatchAcked,
    Input,
    Restore,
    SubmitJob,
    Tick,
)
from broker.core.lifecycle import AttemptLifecycle
from broker.core.moves import PlannedMoves
from broker.core.placement import futile_spot_waits, wants_spot_first
from broker.core.provision import provision_command
from broker.core.records import JobRecord
from broker.core.registry import JobRegistry
from broker.core.scheduler import Scheduler
from broker.core.spotwait import note_spot_held
from broker.core.states import LIVE_STATES, TERMINAL, Event, move
from broker.core.submission import (
    check_service_accounts,
    choose_queue,
    derive_job_id,
    mark_spot_ok,
    queue_full,
    reject,
    resolve_priority,
)
from broker.core.types import CycleResult, GangRequest, Preemption, Reason
from broker.core.views import JobViews
from schemas.agent import (
    AgentEvent,
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

EXPIRY_SCAN_S = 60.0  # how often ended jobs past their retention are looked for
# The event types the broker reads, by exact type: every event of a batch is checked against
# them before any is applied, in one pass of C (`issuperset` over `map(type, ...)`).
KNOWN_EVENTS = frozenset(get_args(AgentEvent))

__all__ = ["LIVE_STATES", "TERMINAL", "AgentTrack", "Machine", "derive_job_id"]


class Machine:
    def __init__(
        self,
        config: BrokerConfig,
        scheduler: Scheduler | None = None,
        epoch: int = 0,
        dispatch_token: Callable[[str, int], str] | None = None,
    ) -> None:
        """`dispatch_token`: the checkpoint token of (job, attempt) each Dispatch carries, a
        keyed hash the shell supplies (broker/sequencer.py); none: no token."""
        self.config = config
        self.scheduler = scheduler if scheduler is not None else Scheduler(config)
        self.epoch = epoch
        self.queues = {q.name: q for q in config.queues}
        self.registry = JobRegistry()
        self._jobs = self.registry.records
        self.backlog = Backlog(self.queues, lambda: self.scheduler.inventory_version)
        self.tracker = AgentTracker(self.scheduler, epoch)
        self.lifecycle = AttemptLifecycle(
            config,
            self.scheduler,
            self.registry,
            self.backlog,
            epoch,
            heard=self.tracker.healthy,
            dispatch_token=dispatch_token,
        )
        self.moves = PlannedMoves(self.registry, self.lifecycle, self.scheduler, self.backlog)
        self.views = JobViews(
            self.registry, self.lifecycle, self.backlog, self.tracker, self.scheduler
        )
        self._order = 0  # the newest submission order handed out or restored
        self._next_expiry = 0.0  # when ended jobs past their retention are looked for next
        # Read-only observers of each admission cycle's result (the simulator's wait-reason
        # counts, `load/sim/reasons.py`); they must not change what they are given.
        self.cycle_observers: list[Callable[[CycleResult], None]] = []

    @property
    def jobs(self) -> dict[str, JobRecord]:
        return self._jobs

    @property
    def reasons(self) -> Mapping[str, tuple[Reason, ...]]:
        return self.registry.reasons

    @property
    def agents(self) -> dict[str, AgentTrack]:
        return self.tracker.tracks

    @property
    def wants_cycle(self) -> bool:
        """Whether a cycle could change anything. Until an agent has reported, only jobs
        queued since the last cycle need one (to be told why they wait): a cycle over a
        restored backlog with no capacity known admits nothing, and held a restarted broker's
        first answer by ~0.25 s at 100,000 jobs. It runs once an agent reports capacity."""
        return self.backlog.wants_cycle and (bool(self.tracker.tracks) or bool(self.backlog.fresh))

    @property
    def spot_return(self) -> bool:
        """Whether running jobs return to spot when it pays (off only to measure it)."""
        return self.moves.spot_return

    @spot_return.setter
    def spot_return(self, on: bool) -> None:
        self.moves.spot_return = on

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
            return self.lifecycle.on_dispatch_result(
                event.job_id,
                event.attempt,
                event.ok,
                event.error,
                now,
                job_only=event.job_only,
                resize_refused=event.resize_refused,
            )
        if isinstance(event, CancelSettled):
            return self.lifecycle.cancel_settled(
                event.job_id, event.attempt, now, event.cluster, event.ended
            )
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
            self.lifecycle.on_checkpoint(event.report, now, out)
            return out
        if isinstance(event, CancelJob):
            error, effects = self._cancel(event.job_id, event.reason, now)
            return [Refused(error)] if error is not None else effects
        if isinstance(event, Restore):
            self._restore(event.records, now)
            return self.lifecycle.resend_unacknowledged(event.records, now)
        assert_never(event)  # every Input is handled above (mypy checks; raises otherwise)

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
        resolved = resolve_priority(self.config, spec)
        if isinstance(resolved, SubmitReply):
            return resolved, []
        refused = check_service_accounts(self.config, resolved)
        if refused is not None:
            return refused, []
        spec = mark_spot_ok(self.queues[queue], resolved)
        if order is None:
            order = self._order + 1
        self._order = max(self._order, order)
        job_id = spec.job_id or derive_job_id(spec.name, id_token or str(order))
        if job_id in self.registry:
            return SubmitReply(accepted=True, job_id=job_id, duplicate=True), []
        pending = self.backlog.pending.get(queue)
        full = queue_full(queue, len(pending or ()), self.config.limits.max_pending_per_queue)
        if full is not None:
            return full, []
        record = JobRecord(
            job_id=job_id, spec=spec, queue=queue, order=order, submitted_at=now, queued_at=now
        )
        # Registered first, so the request is built from the shared spec parts and interned
        # demands the scheduler's memos know (a gang shared with earlier jobs has its demands
        # derived already), and through the backlog's cache: the job's first cycle reuses it
        # instead of building it again.
        self.registry.add(record)
        request = self.backlog.request(record, now, self.registry.demands(job_id))
        problems = self.scheduler.check_feasible(request)
        if problems:
            self.registry.remove(job_id)
            self.backlog.forget(job_id)
            text = "; ".join(r.message for r in problems)
            return reject(f"the gang can never be placed: {text}"), []
        self.backlog.enqueue(record)
        self.moves.watch(record)
        return SubmitReply(accepted=True, job_id=job_id), [
            Persist(record),
            self.lifecycle.event(record, "queued", now),
        ]

    def _why(self, pre: Preemption) -> str:
        """Kueue's "Preempted to accommodate a workload ...", for the victim."""
        preemptor = self._jobs.get(pre.preemptor)
        if preemptor is None:
            return f"to accommodate {pre.preemptor}"
        if pre.kind == "within-queue":
            rule = f"within queue {preemptor.queue}: it has a higher priority (LowerPriority)"
        else:
            rule = f"queue {preemptor.queue} reclaims its nominal quota lent in the cohort"
        return (
            f"to accommodate {pre.preemptor} (priority {preemptor.spec.priority}) on "
            f"{pre.pool[0]}/{pre.pool[1]}, {rule}"
        )

    def _cancel(self, job_id: str, reason: str, now: float) -> tuple[str | None, list[Effect]]:
        """Returns (error, effects). Cancelling a finished job is an error that changes nothing."""
        record = self._jobs.get(job_id)
        if record is None:
            return f"unknown job {job_id!r}", []
        if record.state in TERMINAL:
            verb = "has already" if record.state == "succeeded" else "is already"
            return f"job {job_id} {verb} {record.state}; nothing to cancel", []
        effects: list[Effect] = []
        self.scheduler.spot_waiters.forget(job_id)
        self.lifecycle.finish(record, "cancelled", now, reason, effects)
        return None, effects

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, now: float) -> list[Effect]:
        """One admission cycle over the jobs that could have become admissible."""
        candidates = self.backlog.candidates(self._jobs, self.registry.all_demands, now)
        if not candidates:
            return []
        result = self.scheduler.schedule(candidates, now, self._waiting_for_spot(now))
        for observe in self.cycle_observers:
            observe(result)
        if result.admitted:
            self.backlog.admitted({self._jobs[job_id].queue for job_id, _ in result.admitted})
        effects: list[Effect] = []
        for job_id, placement in result.admitted:
            record = self._jobs[job_id]
            self.backlog.dequeue(record)
            self.registry.clear_reasons(job_id)
            note_spot_held(record, result.spot_held.get(job_id))
            self.lifecycle.admit(record, placement, now, effects)
        for ask in result.provisions:
            effects.append(Send(ask.cluster, provision_command(ask, self.epoch)))
        for pre in result.preemptions:
            for victim_id in pre.victims:
                victim = self._jobs.get(victim_id)
                if victim is None or victim.state not in ("admitted", "running"):
                    continue
                cause = "preempted" if pre.kind == "within-queue" else "reclaimed"
                deadline = now + self.config.timeouts.checkpoint_grace_s
                self.lifecycle.begin_preempt(
                    victim, cause, deadline, now, effects, reserve=False, detail=self._why(pre)
                )
        for job_id, reasons in result.pending.items():
            self.registry.set_reasons(job_id, reasons)
            pending = self._jobs.get(job_id)
            if (
                pending is not None
                and job_id in result.spot_held
                and pending.spec.capacity == "spot-then-on-demand"
            ):
                # it waits for on-demand now: the spot it fits is kept for a spot-only job
                note_spot_held(pending, result.spot_held[job_id])
                effects.append(Persist(pending))
                self.backlog.fresh.add(job_id)
            if (
                pending is not None
                and pending.avoid
                and any(r.code == "pool-avoided" for r in reasons)
            ):
                # Nothing but the avoided pool fits: widen (SkyPilot's EAGER_NEXT_REGION).
                pending.avoid = []
                self.backlog.fresh.add(job_id)
        unplaced = {r.job_id: r for r in candidates if r.job_id in result.pending}
        futile = self.given_up_spot_waits(unplaced, now)
        for request in unplaced.values():
            self.backlog.earlier_waiters.file(request)
        for job_id, ahead in futile.items():
            if job_id in result.spot_held:
                continue  # it stopped waiting for spot already
            record = self._jobs[job_id]
            record.spot_exhausted = True
            record.spot_fallback = (
                f"stopped waiting for spot: {ahead}, queued earlier with no bigger gang, was "
                "already waiting for it, so spot that frees goes there first"
            )
            self.backlog.earlier_waiters.drop(job_id)
            effects.append(Persist(record))
            self.backlog.fresh.add(job_id)
        self.backlog.cycle_done()
        return effects

    def _waiting_for_spot(self, now: float) -> list[GangRequest]:
        """The queued spot-only jobs an earlier cycle left waiting for capacity (not backing
        off; the scheduler keeps the list, spotwait.py); the ones that left the queue since
        are dropped here."""
        out: list[GangRequest] = []
        waiters = self.scheduler.spot_waiters
        for job_id in waiters.ids:
            record = self._jobs.get(job_id)
            if record is None or record.state != "queued":
                waiters.forget(job_id)
            elif record.not_before <= now:
                out.append(self.backlog.request(record, now, self.registry.demands(job_id)))
        return out

    def given_up_spot_waits(self, stuck: Mapping[str, GangRequest], now: float) -> dict[str, str]:
        """The spot-then-on-demand jobs among `stuck` (this cycle's unplaced, as tried) that
        wait for spot behind an earlier queued job (placement.futile_spot_waits): job id ->
        that job. The earlier ones are this cycle's unplaced jobs and the queues' heads an
        earlier cycle left waiting for spot (Backlog.earlier_spot_waiters)."""
        if not any(wants_spot_first(r) for r in stuck.values()):
            return {}
        ahead = self.backlog.earlier_spot_waiters(
            self._jobs, self.registry.all_demands, self.registry.reasons, now, stuck
        )
        futile = futile_spot_waits([*stuck.values(), *ahead])
        return {job_id: earlier for job_id, earlier in futile.items() if job_id in stuck}

    # ------------------------------------------------------------------ agents
    def _on_batch(self, cluster: str, batch: EventBatch, now: float) -> list[Effect]:
        if not KNOWN_EVENTS.issuperset(map(type, batch.events)):
            unknown = next(e for e in batch.events if type(e) not in KNOWN_EVENTS)
            # Refused whole, before its sequence is taken: applying the events around one the
            # broker cannot read would act on half a report, and dropping it would lose it.
            return [
                Refused(
                    f"batch {batch.seq} of cluster {cluster!r} holds an agent event the broker "
                    f"does not know ({type(unknown).__name__}); nothing of the batch was "
                    "applied. Upgrade the broker before its agents"
                )
            ]
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
        event: AgentEvent,
        now: float,
        effects: list[Effect],
    ) -> None:
        if isinstance(event, Heartbeat):
            if (event.stale_s > 0) != (track.stale_s > 0):
                self.scheduler.set_cluster_stale(cluster, event.stale_s > 0)
            track.stale_s = event.stale_s
        elif isinstance(event, ClusterSnapshot):
            self._snapshot(cluster, track, event, now, effects)
        elif isinstance(event, WorkloadStatus):
            self.lifecycle.workload(cluster, event, now, effects)
        elif isinstance(event, CheckpointReport):
            self.lifecycle.on_checkpoint(event, now, effects, cluster=cluster)
        elif isinstance(event, SpotNotice):
            for job_id in self.scheduler.spot_notice(cluster, event.node, event.deadline, now):
                self.lifecycle.spot_notice(job_id, cluster, event, now, effects)
        elif isinstance(event, NodeUpsert):
            lost = self.scheduler.upsert_node(cluster, event.node, now)
            self.lifecycle.retry_growth()
            self.lifecycle.lose_all(
                lost, "node-unusable", now, effects, cluster=cluster, node=event.node.name
            )
        elif isinstance(event, NodeGone):
            lost = self.scheduler.remove_node(cluster, event.node, now)
            self.lifecycle.lose_all(
                lost, "node-lost", now, effects, cluster=cluster, node=event.node
            )
        elif isinstance(event, GpuHealth):
            lost = self.scheduler.set_gpu_health(cluster, event.node, event.healthy, now)
            cause = f"gpu-failure (xid {event.xid})" if event.xid is not None else "gpu-failure"
            self.lifecycle.lose_all(lost, cause, now, effects, cluster=cluster, node=event.node)
        else:
            assert_never(event)  # `_on_batch` refused any other event before this

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
        self.lifecycle.lose_all(lost, "node-lost", now, effects, cluster=cluster)
        reported: set[tuple[str, int]] = set()
        for status in snap.workloads:
            reported.add((status.job_id, status.attempt))
            self.lifecycle.workload(cluster, status, now, effects, snapshot=True)
        self.lifecycle.missing(cluster, reported, now, effects)
        self.lifecycle.retry_growth()

    # ------------------------------------------------------------------ time
    def _tick(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for cluster in self.tracker.silent(now, self.config.timeouts):
            self.scheduler.remove_cluster(cluster, now)
            lost = self.lifecycle.on_cluster(cluster)
            cause = self.tracker.lost_cause(cluster, now, self.config.timeouts)
            self.lifecycle.lose_all(lost, cause, now, effects, cluster=cluster)
        self.lifecycle.expire(now, effects)
        self.backlog.due(self._jobs, now)
        if self.scheduler.provision_claims() and self.scheduler.expire_provisions(now):
            self.backlog.capacity_dirty = True  # a stockout: plan those jobs elsewhere now
        lapsed = self.scheduler.protection_lapsed(now)
        if lapsed:
            self.backlog.wake(lapsed)
        self.moves.tick(now, effects)
        if self.lifecycle.elastic_short or self.lifecycle.elastic_grown:
            top = queued_top(self.backlog.pending, self._jobs)
            grown = self.lifecycle.elastic_grown
            if top is not None and grown and self.lifecycle.give_back_growth(now, effects, top):
                self.backlog.capacity_dirty = True
            self.lifecycle.grow_elastic(now, effects, top)
        if self.lifecycle.health.tick(now):
            self.backlog.capacity_dirty = True  # a pool may take a probe
        self._expire_ended(now, effects)
        return effects

    def _expire_ended(self, now: float, effects: list[Effect]) -> None:
        """Ended jobs past `limits.ended_retention_s` are forgotten and their records deleted:
        the retention is the idempotency window of an ended job's id. Looked for once a
        minute at most (a pass over every record).

        A job whose record marks a Cancel unacknowledged is kept past its retention until the
        Cancel settles (acknowledged, or its cluster lost): the record is what a restored
        leader sends that Cancel again from, and while it is kept a resubmission of its id is
        a duplicate, so no second copy of the id can start beside one a cut-off cluster still
        runs."""
        keep = self.config.limits.ended_retention_s
        if keep <= 0 or now < self._next_expiry:
            return
        self._next_expiry = now + min(EXPIRY_SCAN_S, max(keep / 4, 1.0))
        cut = now - keep
        old = [
            job_id
            for job_id, r in self._jobs.items()
            if r.state in TERMINAL
            and r.finished_at is not None
            and r.finished_at < cut
            and not r.cancels_unsettled
        ]
        for job_id in old:
            self.registry.remove(job_id)
            self.moves.forget(job_id)
            effects.append(Forget(job_id))

    # ------------------------------------------------------------------ recovery after restart
    def _restore(self, records: Iterable[JobRecord], now: float) -> None:
        """Rebuild from persisted records. Live attempts are assumed to hold their placement
        until their agents resend snapshots (or their clusters are declared lost)."""
        queued: list[JobRecord] = []
        add, watch = self.registry.add, self.moves.watch
        order = self._order
        for record in records:
            add(record)
            if record.order > order:
                order = record.order
            for a in record.attempts:
                if a.cancel_unacked:  # its Cancel is asked again: given up once the cluster is lost
                    self.tracker.assume(a.cluster, now)
            if record.state in TERMINAL:
                continue
            watch(record)  # live ones too
            if record.state == "queued":
                queued.append(record)
                continue
            current = record.current
            if current is None:
                move(record, Event.RESTORE_UNPLACED)
                queued.append(record)
                continue
            self.lifecycle.restore(record, current, now)
            self.tracker.assume(current.cluster, now)
        self._order = order
        # Restored queued jobs count as parked, not fresh: each was tried before the restart
        # (or is as good as a parked one), and no cluster has reported yet. The first cycle then
        # takes the `lookahead` heads of each queue, not all 100,000 jobs at once, which would
        # keep a just-restarted broker deaf for seconds. Each queue is sorted once.
        self.backlog.enqueue_many(queued)
        self.backlog.capacity_dirty = True
