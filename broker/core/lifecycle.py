"""The attempt lifecycle: dispatch, run, checkpoint, preempt, lose, fail, finish, requeue.

`AttemptLifecycle` changes job records (their state, attempts and budgets) through the
machine's inputs. It keeps:
- a job has at most one live attempt, and every command carries (job_id, attempt, epoch);
- a record is persisted before the dispatch it describes is sent, and a dispatch names the
  attempts whose Cancels it must follow (`Send.after_cancel_of`, `cancels_before`): the one
  before it and every older one whose Cancel no agent has acknowledged yet;
- an attempt ended while it may still run carries `cancel_unacked` until its Cancel is
  acknowledged, it reports an end, or its cluster is declared lost; a new leader asks again;
- anything an agent reports about an attempt that is not the job's live one is cancelled.

One record write is deferred (`Persist(deferred=True)`: the shell writes it within
`timeouts.deferred_write_s`, or with the job's next urgent write): the attempt found running
(`running_at`, the state `running`, `start_failures` reset). Nothing waits on it, and a
record without it is one whose attempt was acknowledged and had not reported yet: the
restored attempt keeps its placement and counts as starting; its agent's snapshot, sent to
every new leader, lists it running and sets all three again, and the start timeout of a
restored attempt is not judged before that snapshot (`restore`), so it kills nothing healthy.
The dispatch's ack (`acked_at`) stays urgent: a record without it makes the next leader send
the Dispatch again, and a cluster silent to that resend has the attempt given up and the job
run elsewhere while the first copy may still run and finish (the deterministic simulation
found a job completed twice that way with the ack deferred). Every other write stays urgent
too: a dispatch (persist, then send), a cancel and its `cancel_unacked` fence and
`CancelSettled`, an end, a checkpoint (the agent drops it once told its batch is applied), a
preemption, a resize, a requeue.

It owns which jobs are live and where (live, starting, preempting; `live_jobs`, `live_on`,
`on_cluster`, `is_live`) and the spot notice windows seen per pool (advice.py); the ledger's
allocations follow from it (`Scheduler.assume`/`release`), and no one reads the ledger for it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import replace
from typing import assert_never
from urllib.parse import unquote, urlsplit

from broker.core.accounting import (
    accounting_of,
    backoff_delay,
    close_attempt,
    note_resize,
    work_since,
)
from broker.core.advice import advised_interval_s
from broker.core.backlog import Backlog
from broker.core.effects import Effect, Persist, Publish, Send
from broker.core.elastic import (
    GROW_RETRY_S,
    MOVE_START_S,
    Priced,
    grown,
    growth,
    only_grew,
    refused_growth_text,
    short,
    shrink_or_move,
    shrink_text,
    without_node,
)
from broker.core.health import PoolHealth
from broker.core.policy import no_progress_reason, no_progress_verdict
from broker.core.records import (
    AttemptRecord,
    AvoidPool,
    JobRecord,
    LatestCheckpoint,
    Preempting,
    compact,
    gang_request,
    preempting_text,
)
from broker.core.registry import JobRegistry
from broker.core.risk import NoticeWindows
from broker.core.scheduler import Scheduler
from broker.core.speed import observe
from broker.core.spotwait import note_spot_held
from broker.core.starts import restore_estimate_s, start_failures_exhausted, start_limit_s
from broker.core.states import (
    LIVE_STATES,
    PLANNED_MOVES,
    TERMINAL,
    Cause,
    Event,
    end_event,
    move,
)
from broker.core.types import Placement
from schemas.agent import (
    TERMINAL_PHASES,
    Cancel,
    CheckpointNow,
    CheckpointReport,
    Dispatch,
    FlavorInfo,
    PodSetAssignment,
    SpotNotice,
    WorkloadStatus,
)
from schemas.api import EventKind, JobEvent, JobState
from schemas.config import BrokerConfig

MISSING_GRACE_S = 5.0  # an acknowledged dispatch a snapshot does not list yet is not missing
UNSYNCED_RECHECK_S = 1.0  # start timeouts waiting for a restored cluster's snapshot: rechecked


class AttemptLifecycle:
    def __init__(
        self,
        config: BrokerConfig,
        scheduler: Scheduler,
        registry: JobRegistry,
        backlog: Backlog,
        epoch: int,
        health: PoolHealth | None = None,
        heard: Callable[[str], bool] = lambda _: True,
        dispatch_token: Callable[[str, int], str] | None = None,
    ) -> None:
        self._config = config
        self._token = dispatch_token
        # Whether a cluster's agent is heard now: a replacement waits while the attempt it
        # replaces runs on a silent cluster (its fence, minutes long, has not lapsed).
        self._heard = heard
        self._scheduler = scheduler
        self._registry = registry
        self._jobs = registry.records
        self._backlog = backlog
        self.epoch = epoch
        self._live: set[str] = set()
        self._live_on: dict[str, set[str]] = {}  # cluster -> jobs whose live attempt runs there
        self._starting: set[str] = set()  # dispatched, not every replica running yet
        # No start timeout of `_starting` falls due before this (a lower bound, kept on every
        # add): most ticks skip the scan, which took a quarter to half of a busy broker's time.
        self._starting_due = -math.inf
        # Jobs whose record holds a `Preempting`: an index of the records, written with them
        # in `_set_preempting` only (invariants.one_state checks it).
        self._preempting: set[str] = set()
        self._windows = NoticeWindows()  # notice windows per pool (advice.py)
        self._fence_after = config.timeouts.fence_window_s
        sc = config.scheduling
        self.health = health or PoolHealth(scheduler, sc.breaker_failures, sc.breaker_cool_down_s)
        # Dispatched attempts their agent has not reported yet: job -> the time by which it
        # must (None until the dispatch is acknowledged). Not persisted: after a restart the
        # agents' snapshots report every attempt, or `missing` loses it.
        self._unreported: dict[str, float | None] = {}
        # No entry of `_unreported` falls due before this (a tick looks at none until then).
        self._unreported_due = math.inf
        # Jobs whose live attempt has an elastic podset below its maximum (elastic.py): the
        # ones `grow_elastic` looks at. May hold jobs that ended since (they are skipped).
        self.elastic_short: set[str] = set()
        self.elastic_grown: set[str] = set()  # ... whose live attempt holds nodes growth added
        self._grow_retry: dict[str, float] = {}  # job -> when growth that found no room retries
        # Clusters with a restored attempt not known to run, whose agent has not sent a
        # snapshot since the restore: the start timeouts there wait for it (`restore`).
        self._unsynced: set[str] = set()

    # ------------------------------------------------------------------ which jobs are live
    def live_jobs(self) -> Set[str]:
        """Jobs with a live attempt (read-only)."""
        return self._live

    def is_live(self, job_id: str) -> bool:
        return job_id in self._live

    def live_count(self) -> int:
        return len(self._live)

    def preempting_jobs(self) -> Set[str]:
        """Jobs being preempted: those whose record holds a `Preempting` (read-only)."""
        return self._preempting

    def _set_preempting(self, record: JobRecord, pre: Preempting | None) -> None:
        """The one writer of `record.preempting`, and of the index of the jobs that have one.
        The job's state follows it through the table: `preempting` exactly while it is set."""
        record.preempting = pre
        if pre is None:
            self._preempting.discard(record.job_id)
        else:
            self._preempting.add(record.job_id)

    def live_on(self, cluster: str) -> Set[str]:
        """Jobs whose live attempt runs on the cluster (read-only)."""
        return self._live_on.get(cluster, _NONE)

    def on_cluster(self, cluster: str) -> list[str]:
        """Jobs that hold anything on the cluster: a live attempt, or a reserved replacement."""
        jobs = set(self._live_on.get(cluster, ()))
        for job_id in self._preempting:
            pre = self._jobs[job_id].preempting
            rep = pre.replacement if pre is not None else None
            if rep is not None and rep.cluster == cluster:
                jobs.add(job_id)
        return sorted(jobs)

    # ------------------------------------------------------------------ inputs
    def workload(
        self,
        cluster: str,
        status: WorkloadStatus,
        now: float,
        effects: list[Effect],
        *,
        snapshot: bool = False,
    ) -> None:
        record = self._jobs.get(status.job_id)
        current = record.current if record is not None else None
        if (
            record is None
            or current is None
            or current.attempt != status.attempt
            or current.cluster != cluster
        ):
            old = _ended_attempt(record, cluster, status.attempt)
            if status.phase in ("created", "running"):
                # A copy the broker does not consider live: fence it off.
                reason = "stale attempt: not the job's live attempt"
                if record is not None and old is not None:
                    if not old.cancel_unacked:
                        effects.append(Persist(record))
                    effects.append(self._cancel(record, old, reason))
                else:
                    cmd = Cancel(
                        job_id=status.job_id,
                        epoch=self.epoch,
                        attempt=status.attempt,
                        reason=reason,
                    )
                    effects.append(Send(cluster, cmd))
                return
            if record is not None and old is not None and old.cancel_unacked:
                old.cancel_unacked = False  # it reported its end: it no longer runs
                effects.append(Persist(record))
            if record is not None and status.phase == "succeeded":
                self._late_success(record, cluster, status, now, effects)
            return
        if record.job_id in self._unreported:  # the cluster took the dispatch
            del self._unreported[record.job_id]
            if self.health.success((cluster, current.flavor), record.job_id, current.attempt):
                self._backlog.capacity_dirty = True
        phase = status.phase
        match phase:
            case "running":
                self._running(record, current, status, now, effects, snapshot=snapshot)
            case "succeeded":
                self.finish(record, "succeeded", now, status.reason or None, effects)
            case "failed":
                self._failed(record, status, now, effects)
            case "evicted":
                self._lose(record, status.reason or "evicted", now, effects)
            case "created":
                pass  # made, not yet running: the start timeout watches it
            case _:
                assert_never(phase)

    def _running(
        self,
        record: JobRecord,
        current: AttemptRecord,
        status: WorkloadStatus,
        now: float,
        effects: list[Effect],
        *,
        snapshot: bool,
    ) -> None:
        """A running report: the attempt runs once every replica does."""
        if status.running_replicas >= max(status.total_replicas, 1) and current.running_at is None:
            current.running_at = now
            self._starting.discard(record.job_id)  # its start timeout no longer applies
            record.start_failures = 0
            if record.state == "admitted":
                move(record, Event.ALL_RUNNING)
            self._scheduler.note_progress(
                record.job_id, current.attempt, work_since(record, current)
            )
            effects.append(Persist(record, deferred=True))  # see the module docstring
            effects.append(self.event(record, "running", now))
        elif current.running_at is not None and status.reason and not snapshot:
            # Running again with a note: replicas restarted in place (a crash loop shows
            # before the operator gives up). Nothing changes but what users are told; a
            # snapshot repeats the note of an old restart, so it says nothing.
            effects.append(self.event(record, "restarted", now, reason=status.reason))

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
            effects.append(self._cancel(record, newer, "an earlier attempt succeeded"))
        old.end_cause = "succeeded"
        old.gpu_seconds_lost = 0.0  # its work was not lost after all
        reason = f"attempt {old.attempt} on {cluster} succeeded after it was given up"
        self.finish(record, "succeeded", now, reason, effects)

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
        record = self._jobs.get(report.job_id)
        if record is None:
            return
        current = record.current
        if current is None or current.attempt != report.attempt:
            return
        reason = checkpoint_doubt(record, current, report, now, cluster)
        if reason:
            effects.append(
                self.event(record, "checkpoint-refused", now, step=report.step, reason=reason)
            )
            return
        latest = record.latest_checkpoint
        if latest is None or report.step > latest.step:
            anchor = None if latest is None else (latest.attempt, latest.step, latest.at)
            observe(record.speeds, anchor, current.attempt, current.gpu_type, report.step, now)
            record.latest_checkpoint = LatestCheckpoint(
                step=report.step, uri=report.uri, at=now, attempt=report.attempt
            )
            self._scheduler.note_progress(
                record.job_id, current.attempt, work_since(record, current)
            )
            effects.append(Persist(record))
            effects.append(self.event(record, "checkpointed", now, step=report.step))
        pre = record.preempting
        if pre is not None and (pre.step_at_start is None or report.step > pre.step_at_start):
            self._finish_preempt(record, now, effects)

    def on_dispatch_result(
        self,
        job_id: str,
        attempt: int,
        ok: bool,
        error: str,
        now: float,
        *,
        job_only: bool = False,
        resize_refused: bool = False,
    ) -> list[Effect]:
        record = self._jobs.get(job_id)
        if record is None:
            return []
        current = record.current
        if current is None or current.attempt != attempt:
            return []
        if ok:
            if current.acked_at is not None:
                if current.settled is None and not current.unsettled:
                    return []
                current.settled = None  # the agent took the newest revision
                current.unsettled = False
                return [Persist(record)]
            # Persisted at once, not deferred (module docstring): after a restart, a dispatch
            # without it is sent again.
            current.acked_at = now
            window = self._config.timeouts.dispatch_report_s
            if window > 0 and job_id in self._unreported:
                self._unreported[job_id] = now + window
                self._unreported_due = min(self._unreported_due, now + window)
            return [Persist(record)]
        if current.acked_at is not None and current.revision > 0:
            if resize_refused:
                # The workload cannot run at the revision's size (its kind cannot resize in
                # place): a growth is given back and the attempt runs on at the size it has;
                # a shrink (its node is going) moves the whole gang from its checkpoint.
                moved: list[Effect] = []
                if self.give_back_refused(record, current, error, now, moved):
                    return moved
                self._lose(record, "resize-refused", now, moved, detail=error)
                return moved
            # A resize the agent did not take (or the shell gave up on): the attempt it
            # acknowledged runs on, and its cluster's health decides what happens to it. What
            # it runs is unknown now, so a later refusal is not given back but moved whole.
            if current.unsettled:
                return []
            current.settled = None
            current.unsettled = True
            return [Persist(record)]
        effects: list[Effect] = []
        self._start_failed(
            record,
            current,
            f"dispatch-failed: {error}",
            "dispatch failed",
            f"dispatch failed on {current.cluster}: {error}",
            now,
            effects,
            pool_failed=True,
            job_only=job_only,
        )
        return effects

    def _start_failed(
        self,
        record: JobRecord,
        current: AttemptRecord,
        cause: str,
        cancel_reason: str,
        reason: str,
        now: float,
        effects: list[Effect],
        *,
        pool_failed: bool = False,
        job_only: bool = False,
    ) -> None:
        """The attempt never ran: end it, keep its next try off the pool that failed it, and
        fail the job once its start failures in a row pass the cap (starts.py). A pool that
        refused or swallowed the dispatch (`pool_failed`) also counts a failure on its dispatch
        breaker, unless it refused this job alone (`job_only`: its team's quota there), and
        the job's first such failure goes elsewhere at once, without backoff."""
        if pool_failed and not job_only:
            pool = (current.cluster, current.flavor)
            self.health.failure(pool, record.job_id, current.attempt, reason, now)
        record.start_failures += 1
        self._end_attempt(record, current, cause, now, lost=True)
        effects.append(self._cancel(record, current, cancel_reason))
        self._avoid_pool(record, current, now)
        exhausted = start_failures_exhausted(record)
        if exhausted is not None:
            self.finish(record, "failed", now, f"{exhausted}; last: {reason}", effects)
            return
        failures = record.start_failures
        first_refusal = pool_failed and failures <= 1
        delay = 0.0 if first_refusal else backoff_delay(record, failures)
        self._requeue(record, now, delay, effects, reason=reason)

    def admit(
        self, record: JobRecord, placement: Placement, now: float, effects: list[Effect]
    ) -> None:
        """Dispatch the next attempt of a queued job the scheduler admitted at `placement`."""
        attempt = self.attempt_for(record, placement, now)
        # placement.note: a partial admission says so in the admitted event
        self._dispatch(record, attempt, now, effects, note=placement.note or None)
        if short(record.spec, attempt.assignment):
            self.elastic_short.add(record.job_id)

    def missing(
        self, cluster: str, reported: set[tuple[str, int]], now: float, effects: list[Effect]
    ) -> None:
        """A cluster's snapshot listed `reported` (job_id, attempt): the live attempts on it
        that it left out are lost, once they ran or were acknowledged a while ago."""
        self._unsynced.discard(cluster)  # its restored attempts' start timeouts count again
        for job_id in list(self._live_on.get(cluster, ())):
            record = self._jobs[job_id]
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

    def expire(self, now: float, effects: list[Effect]) -> None:
        """Time passed: preemptions whose checkpoint grace ran out go ahead, and dispatches
        whose replicas did not all run within the start timeout are given up."""
        for job_id in list(self._preempting):
            record = self._jobs[job_id]
            pre = record.preempting
            if pre is not None and now >= pre.deadline:
                self._finish_preempt(record, now, effects)
        self._swallowed(now, effects)
        if now < self._starting_due:
            return
        self._starting_due = math.inf  # lowered below, and by any dispatch meanwhile
        for job_id in list(self._starting):
            record = self._jobs[job_id]
            current = record.current
            if current is None or current.running_at is not None or record.preempting:
                self._starting.discard(job_id)
                continue
            if current.cluster in self._unsynced:  # it may run: its snapshot will say
                self._starting_due = min(self._starting_due, now + UNSYNCED_RECHECK_S)
                continue
            limit = start_limit_s(record, current, self._config.timeouts)
            if now - current.dispatched_at > limit:
                reason = f"not all replicas ran within {limit:g}s on {current.cluster}"
                self._start_failed(
                    record, current, "start-timeout", "start timeout", reason, now, effects
                )
            else:
                self._starting_due = min(self._starting_due, self._start_due(record, current))

    def _start_due(self, record: JobRecord, current: AttemptRecord) -> float:
        """A time before which the attempt's start timeout cannot lapse (a hair early, so
        that float rounding never makes the scan late)."""
        limit = start_limit_s(record, current, self._config.timeouts)
        return current.dispatched_at + limit * (1 - 1e-9) - 1e-6

    def _add_starting(self, record: JobRecord, current: AttemptRecord) -> None:
        self._starting.add(record.job_id)
        self._starting_due = min(self._starting_due, self._start_due(record, current))

    def _swallowed(self, now: float, effects: list[Effect]) -> None:
        """Acknowledged dispatches their agent never reported (created or running) within
        `timeouts.dispatch_report_s`: the cluster swallowed them. Not while the cluster takes
        no placements (silent or stale): cluster health deals with that."""
        if now <= self._unreported_due:
            return
        window = self._config.timeouts.dispatch_report_s
        due = [j for j, t in self._unreported.items() if t is not None and now > t]
        # What is not due now, and what stays due (its cluster takes no placements), sets when
        # to look again.
        self._unreported_due = min(
            (t for t in self._unreported.values() if t is not None and now <= t), default=math.inf
        )
        clusters = self._scheduler.cluster_states()
        for job_id in due:
            record = self._jobs[job_id]
            current = record.current
            if current is None or record.preempting is not None:
                self._unreported.pop(job_id, None)
                continue
            c = clusters.get(current.cluster)
            if c is None or not c.schedulable:
                self._unreported_due = min(self._unreported_due, now)  # due at the next tick
                continue
            del self._unreported[job_id]
            reason = (
                f"dispatch to {current.cluster} not reported by its agent within {window:g}s "
                "of its acknowledgement"
            )
            self._start_failed(
                record,
                current,
                "dispatch-unreported",
                "dispatch unreported",
                reason,
                now,
                effects,
                pool_failed=True,
            )

    def restore(self, record: JobRecord, current: AttemptRecord, now: float) -> None:
        """After a restart: a persisted live attempt (and its reserved replacement) holds its
        placement until its agent resends a snapshot or its cluster is declared lost."""
        request = gang_request(record, now, self._registry.demands(record.job_id))
        request.attempt = current.attempt
        self._scheduler.assume(request, placement_of(current))
        self._track_live(record, current.cluster)
        if current.running_at is None:
            # It may run: the record may lack a deferred `running` write, or it started while
            # no leader listened. Its start timeout waits for its cluster's first snapshot.
            self._add_starting(record, current)
            self._unsynced.add(current.cluster)
        if short(record.spec, current.assignment):
            self.elastic_short.add(record.job_id)
        if current.grown:
            self.elastic_grown.add(record.job_id)
        self._set_preempting(record, record.preempting)
        if record.preempting is not None and record.preempting.replacement is not None:
            rep = record.preempting.replacement
            request.attempt = rep.attempt
            self._scheduler.assume(request, placement_of(rep))
        since = work_since(record, current)
        self._scheduler.note_progress(record.job_id, current.attempt, since)

    def resend_unacknowledged(self, records: Iterable[JobRecord], now: float) -> list[Effect]:
        """After a restart: send again every Cancel no agent acknowledged (the attempt may
        still run, and the shell's barrier for it died with the previous leader), then every
        dispatch persisted without an acknowledgement, ordered after them. The previous
        leader may have died before or while sending it; agents acknowledge a duplicate
        (job_id, attempt) without starting a second copy. The start timeout counts from this
        send."""
        effects: list[Effect] = [
            self._cancel(record, a, "cancel unacknowledged before a restart")
            for record in records
            for a in record.attempts
            if a.cancel_unacked
        ]
        for job_id in sorted(self._starting):
            record = self._jobs[job_id]
            current = record.current
            if (
                current is None
                or current.acked_at is not None
                or current.running_at is not None
                or record.preempting is not None
            ):
                continue
            current.dispatched_at = now
            before = previous_attempt(record, current)
            old = next((a for a in record.attempts if a.attempt == before), None)
            if old is not None and not old.cancel_unacked:
                # A record of a broker that did not mark unacknowledged Cancels: the Cancel the
                # previous leader owed the replaced attempt may have died with it. Send it
                # again, so the shell orders the dispatch after it.
                effects.append(self._cancel(record, old, "replaced"))
                effects.append(Persist(record))
            effects.append(self._dispatch_send(record, current))
        return effects

    # ------------------------------------------------------------------ the attempt's steps
    def attempt_for(self, record: JobRecord, placement: Placement, now: float) -> AttemptRecord:
        flavor = self._flavor(placement.cluster, placement.flavor)
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

    def _flavor(self, cluster: str, flavor: str) -> FlavorInfo | None:
        """What the cluster's agent said about the flavor; the inventory is its one owner."""
        return self._scheduler.flavor_info(cluster, flavor)

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
        pool = (attempt.cluster, attempt.flavor)  # checkpoint advice for this pool (advice.py)
        attempt.advised_interval_s = advised_interval_s(
            record.spec,
            self._scheduler.pool_interruption_rate(pool, now),
            len(_nodes(attempt)),
            self._windows.get(pool),
        )
        record.attempt = attempt.attempt
        record.attempts.append(attempt)
        move(record, Event.DISPATCH)
        record.reason = None
        self._track_live(record, attempt.cluster)
        self._add_starting(record, attempt)
        self._unreported[record.job_id] = None
        self.health.dispatched((attempt.cluster, attempt.flavor), record.job_id, attempt.attempt)
        effects.append(Persist(record))
        effects.append(self._dispatch_send(record, attempt))
        effects.append(
            self.event(
                record,
                "admitted",
                now,
                reason=note,
                resume_from_step=attempt.resume_from.step if attempt.resume_from else None,
            )
        )

    def _dispatch_send(self, record: JobRecord, attempt: AttemptRecord) -> Send:
        """The Dispatch of `attempt`, ordered after the Cancels of the attempts before it that
        may still run (those in flight): break before make, never two live copies. The spec
        names the queue the job is in (a job sent to a queue's subject, or by an alias, may
        not say it): an agent places a team's workloads by it."""
        spec = record.spec
        if spec.queue != record.queue:
            # A copy, not `structs.replace`: the spec was validated when it was submitted.
            spec = copy.copy(spec)
            spec.queue = record.queue
        cmd = Dispatch(
            job_id=record.job_id,
            attempt=attempt.attempt,
            epoch=self.epoch,
            flavor=attempt.flavor,
            assignment=attempt.assignment,
            spec=spec,
            resume_from=attempt.resume_from,
            checkpoint_uri=attempt_location(spec.checkpoint.uri, attempt.attempt)
            if spec.checkpoint and spec.checkpoint.uri
            else "",
            fence_after_s=self._fence_after,
            checkpoint_interval_s=attempt.advised_interval_s or 0.0,
            revision=attempt.revision,
            checkpoint_token=self._token(record.job_id, attempt.attempt) if self._token else "",
        )
        return Send(attempt.cluster, cmd, after_cancel_of=cancels_before(record, attempt))

    def spot_notice(
        self, job_id: str, cluster: str, notice: SpotNotice, now: float, effects: list[Effect]
    ) -> None:
        record = self._jobs.get(job_id)
        if record is None:
            return
        live = record.current
        if live is not None and live.cluster == cluster and notice.node in _nodes(live):
            self._windows.observe((cluster, live.flavor), notice.deadline - now)  # advice.py
        pre = record.preempting
        if pre is not None:
            rep = pre.replacement
            if rep is not None and rep.cluster == cluster and notice.node in _nodes(rep):
                # The reserved replacement is itself being reclaimed: reserve again elsewhere.
                self._scheduler.release(job_id, rep.attempt)
                pre.replacement = None
                self._reserve_replacement(record, now)
                effects.append(Persist(record))
            return
        if record.state not in ("admitted", "running"):
            return
        current = record.current
        if current is None or current.cluster != cluster:
            return
        why: list[str] = []
        if self.shrink_in_place(
            record, notice.node, Cause.SPOT_NOTICE, now, effects, notice=notice.deadline, why=why
        ):
            return
        self.begin_preempt(
            record,
            Cause.SPOT_NOTICE,
            notice.deadline,
            now,
            effects,
            reserve=True,
            detail="; ".join(why),
        )

    def shrink_in_place(
        self,
        record: JobRecord,
        node: str,
        cause: str,
        now: float,
        effects: list[Effect],
        *,
        price: bool = True,
        notice: float | None = None,
        why: list[str] | None = None,
    ) -> bool:
        """An elastic gang that stays at or above its minimum without `node` loses only the
        replicas there: the same attempt goes on, told its nodes by a Dispatch revision
        (elastic.py). False when the whole gang has to move: below its minimum, or (`price`)
        when a move does more work (`elastic.shrink_or_move`; its reason lands in `why`).
        `notice`: the reclaim deadline of a spot notice, when there is one."""
        current = record.current
        if current is None or record.preempting is not None:
            return False
        if record.state not in ("admitted", "running"):
            return False
        kept = without_node(record.spec, current.assignment, node)
        if kept is None:
            return False
        reason = f"{cause} on {node}"
        if price:
            priced = self._price_shrink(record, current, kept, notice, now)
            if not priced.shrink:
                if why is not None:
                    why.append(priced.reason)
                return False
            reason = f"{reason}, {priced.reason}"
        if not self._scheduler.shrink(record.job_id, current.attempt, node):
            return False
        current.grown = [n for n in current.grown if n != node]
        self._resized(record, current, kept, reason, now, effects)
        self.elastic_short.add(record.job_id)
        return True

    def _price_shrink(
        self,
        record: JobRecord,
        current: AttemptRecord,
        kept: list[PodSetAssignment],
        notice: float | None,
        now: float,
    ) -> Priced:
        """`elastic.shrink_or_move` for this attempt: the whole gang's placement elsewhere
        (a dry run with the attempt's own quota still charged, so a move that needs that
        quota is not offered), the work a move redoes (none when a spot notice leaves time to
        write a checkpoint: the move asks for one) and its restart (`starts.restore_estimate_s`
        plus `elastic.MOVE_START_S`)."""
        request = gang_request(record, now, self._registry.demands(record.job_id))
        request.avoid_pools = request.avoid_pools | {(current.cluster, current.flavor)}
        got = self._scheduler.assign(request, now)
        elsewhere = None if isinstance(got, tuple) else {d.podset: d.replicas for d in got.podsets}
        ckpt = record.spec.checkpoint
        if notice is not None and ckpt is not None and notice - now >= (ckpt.cost_s or 0.0):
            lost = 0.0
        else:
            lost = max(0.0, now - work_since(record, current))
        return shrink_or_move(
            record.spec,
            {a.podset: len(a.nodes) for a in current.assignment},
            {a.podset: len(a.nodes) for a in kept},
            elsewhere,
            lost,
            restore_estimate_s(record) + MOVE_START_S,
        )

    def give_back_refused(
        self,
        record: JobRecord,
        current: AttemptRecord,
        error: str,
        now: float,
        effects: list[Effect],
    ) -> bool:
        """The agent refused a revision that only grew the attempt: the workload runs whole
        at the size it last took (`settled`), so the growth's nodes and quota go back, the
        attempt goes on at that size and is not grown again (`grow_refused`, in `why`).
        False when a refused revision also shrank it (its node is going: it must move)."""
        settled = current.settled
        if settled is None or record.preempting is not None:
            return False
        if not only_grew(settled, current.assignment):
            return False
        request = gang_request(record, now, self._registry.demands(record.job_id))
        request.attempt = current.attempt
        running = replace(placement_of(current), assignment=placement_of_nodes(settled))
        if not self._scheduler.settle(request, running):
            return False
        why = refused_growth_text(current.cluster, error)
        what = shrink_text(current.assignment, settled)
        kept = {n for a in settled for n in a.nodes}
        current.grown = [n for n in current.grown if n in kept]
        current.assignment = list(settled)
        current.settled = None
        current.grow_refused = why
        self.elastic_short.discard(record.job_id)
        if not current.grown:
            self.elastic_grown.discard(record.job_id)
        effects.append(Persist(record))
        reason = f"growth given back, {why}: {what}"
        effects.append(self.event(record, "resized", now, reason=reason))
        return True

    def give_back_growth(self, now: float, effects: list[Effect], queued_top: int) -> bool:
        """Growth is the first thing reclaimed: while a queued job of the same or higher
        priority waits, elastic attempts give back the nodes growth added (newest first),
        never what they were admitted with. True when some capacity was given back."""
        gave = False
        for job_id in sorted(self.elastic_grown):
            record = self._jobs.get(job_id)
            current = record.current if record is not None else None
            if record is None or current is None or not current.grown:
                self.elastic_grown.discard(job_id)
                continue
            if queued_top < record.spec.priority:
                continue
            cause = f"growth given back to a queued job of priority {queued_top}"
            for node in reversed(current.grown):
                gave = self.shrink_in_place(record, node, cause, now, effects, price=False) or gave
        return gave

    def grow_elastic(self, now: float, effects: list[Effect], queued_top: int | None) -> None:
        """Elastic attempts below their maximum take back what their own pool has free
        (elastic workers share one rendezvous and fabric: never another pool), as much as
        quota and nodes allow. Never while a queued job of the same or higher priority
        (`queued_top`, the highest queued priority) waits: growth must not take what it
        could use."""
        for job_id in sorted(self.elastic_short):
            record = self._jobs.get(job_id)
            current = record.current if record is not None else None
            if record is None or current is None or not short(record.spec, current.assignment):
                self.elastic_short.discard(job_id)
                continue
            if record.preempting is not None or record.state not in ("admitted", "running"):
                continue
            if current.grow_refused:
                self.elastic_short.discard(job_id)
                continue
            if queued_top is not None and queued_top >= record.spec.priority:
                continue
            if self._grow_retry.get(job_id, 0.0) > now:
                continue
            base = gang_request(record, now, self._registry.demands(job_id))
            base.attempt = current.attempt
            extra = growth(base, record.spec, current.assignment)
            more = self._scheduler.grow(extra, now) if extra is not None else None
            if more is None:
                self._grow_retry[job_id] = now + GROW_RETRY_S
                continue
            self._grow_retry.pop(job_id, None)
            current.grown = list(dict.fromkeys([*current.grown, *more.nodes]))
            self.elastic_grown.add(job_id)
            self._resized(
                record, current, grown(current.assignment, more), "capacity returned", now, effects
            )

    def retry_growth(self) -> None:
        """Nodes arrived: growth that found no room may find some now."""
        self._grow_retry.clear()

    def _resized(
        self,
        record: JobRecord,
        current: AttemptRecord,
        assignment: list[PodSetAssignment],
        why: str,
        now: float,
        effects: list[Effect],
    ) -> None:
        """The live attempt runs on `assignment` now (same attempt, next revision)."""
        note_resize(record, current, now)
        if current.settled is None and not current.unsettled:
            current.settled = list(current.assignment)
        what = shrink_text(current.assignment, assignment)
        current.assignment = assignment
        current.revision += 1
        effects.append(Persist(record))
        effects.append(self._dispatch_send(record, current))
        effects.append(self.event(record, "resized", now, reason=f"{why}: {what}"))

    def _reserve_replacement(self, record: JobRecord, now: float) -> None:
        """Make-before-break: hold a placement for the next attempt away from the lost pool."""
        current = record.current
        pre = record.preempting
        if current is None or pre is None:
            return
        request = gang_request(record, now, self._registry.demands(record.job_id))
        request.avoid_pools = request.avoid_pools | {(current.cluster, current.flavor)}
        if self._spot_fallback_due(record, extra=1):
            request.spot_exhausted = True
        held: list[str] = []
        got = self._scheduler.reserve(request, now, replacing_attempt=current.attempt, held=held)
        if isinstance(got, Placement):
            pre.replacement = self.attempt_for(record, got, now)
            note_spot_held(record, held[0] if held else None)

    def begin_preempt(
        self,
        record: JobRecord,
        cause: str,
        deadline: float,
        now: float,
        effects: list[Effect],
        *,
        reserve: bool,
        replacement: AttemptRecord | None = None,
        detail: str = "",
    ) -> None:
        """`replacement`: a placement already reserved for the next attempt (a planned move);
        it is dispatched once the old attempt ends, even when that is at once. `detail`: who
        the preemption makes room for, for the victim's events and status."""
        current = record.current
        if current is None or record.preempting is not None:
            return
        latest = record.latest_checkpoint
        pre = Preempting(
            cause=cause,
            deadline=deadline,
            started_at=now,
            step_at_start=latest.step if latest is not None else None,
            replacement=replacement,
            detail=detail,
        )
        self._set_preempting(record, pre)
        move(record, Event.PREEMPT)
        if reserve:
            self._reserve_replacement(record, now)
        effects.append(Persist(record))
        effects.append(self.event(record, "preempting", now, reason=preempting_text(pre)))
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

    def _finish_preempt(
        self, record: JobRecord, now: float, effects: list[Effect], *, gone: bool = False
    ) -> None:
        """End the preempted attempt and start its replacement. Unless the old copy is known
        to be `gone` (lost, failed), this waits while its cluster is silent: a Cancel would
        not be heard, and the old copy may run until its fence lapses; the cluster speaks
        again (the Cancel is heard) or is declared lost (the fence lapsed) first."""
        pre = record.preempting
        if pre is None:
            return
        live = record.current
        if not gone and live is not None and not self._heard(live.cluster):
            return
        self._set_preempting(record, None)
        current = record.current
        if current is not None:
            self._end_attempt(record, current, pre.cause, now, lost=True)
            effects.append(self._cancel(record, current, pre.cause))
            if pre.cause == Cause.SPOT_NOTICE:
                record.avoid.append(
                    AvoidPool(
                        current.cluster,
                        current.flavor,
                        now + self._config.scheduling.avoid_lost_pool_s,
                    )
                )
        planned = pre.cause in PLANNED_MOVES  # the broker's choice, not a loss
        if not planned and self._charge_preemption(record, current, now, pre.cause, effects):
            if pre.replacement is not None:
                self._scheduler.release(record.job_id, pre.replacement.attempt)
            return
        if pre.replacement is not None:
            self._dispatch(record, pre.replacement, now, effects)
        else:
            self._requeue(record, now, 0.0, effects, reason=preempting_text(pre))

    def lose_all(
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
            record = self._jobs.get(job_id)
            if record is None or record.state not in LIVE_STATES:
                continue
            pre = record.preempting
            if pre is not None and pre.replacement is not None:
                rep = pre.replacement
                if rep.cluster == cluster and (node is None or node in _nodes(rep)):
                    # The reserved replacement lost its capacity: fall back to the queue.
                    self._scheduler.release(job_id, rep.attempt)
                    pre.replacement = None
                    effects.append(Persist(record))
            current = record.current
            if current is None or current.cluster != cluster:
                continue
            if node is not None and node not in _nodes(current):
                continue
            why: list[str] = []
            shrunk = node is not None and self.shrink_in_place(
                record, node, cause, now, effects, why=why
            )
            if shrunk:
                continue
            self._lose(record, cause, now, effects, detail="; ".join(why))

    def _avoid_pool(self, record: JobRecord, attempt: AttemptRecord, now: float) -> None:
        """The job's next attempts keep off the pool that just lost or failed to start it."""
        until = now + self._config.scheduling.avoid_lost_pool_s
        record.avoid.append(AvoidPool(attempt.cluster, attempt.flavor, until))

    def _lose(
        self, record: JobRecord, cause: str, now: float, effects: list[Effect], detail: str = ""
    ) -> None:
        """The live attempt is gone without warning (node, GPU, cluster, eviction). `detail`:
        why an elastic gang moved whole rather than shrink, for the requeued event."""
        current = record.current
        if current is None:
            return
        if record.preempting is not None:
            self._finish_preempt(record, now, effects, gone=True)
            return
        self._end_attempt(record, current, cause, now, lost=True)
        effects.append(self._cancel(record, current, cause))
        self._avoid_pool(record, current, now)
        if self._charge_preemption(record, current, now, cause, effects):
            return
        self._requeue(record, now, 0.0, effects, reason=f"{cause}: {detail}" if detail else cause)

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
            self.finish(record, "failed", now, no_progress_reason(record), effects)
            return True
        limit = record.spec.restart.max_preemptions
        if limit is not None and record.preemptions > limit:
            self.finish(
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
            self._finish_preempt(record, now, effects, gone=True)
            return
        policy = record.spec.restart
        codes = [c for c in status.exit_codes if c != 0]
        detail = f"exit codes {codes}" + (f": {status.reason}" if status.reason else "")
        if policy.retriable_exit_codes and not any(c in policy.retriable_exit_codes for c in codes):
            self.finish(
                record,
                "failed",
                now,
                f"{detail}; not in restart.retriable_exit_codes {policy.retriable_exit_codes}",
                effects,
            )
            return
        record.errors += 1
        if record.errors > policy.max_restarts_on_error:
            self.finish(
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
        self._requeue(record, now, backoff_delay(record, record.errors), effects, reason=detail)

    def finish(
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
                effects.append(self._cancel(record, current, state))
        pre = record.preempting
        if pre is not None and pre.replacement is not None:
            self._scheduler.release(record.job_id, pre.replacement.attempt)
        self._set_preempting(record, None)
        self._backlog.dequeue(record)
        self._registry.clear_reasons(record.job_id)
        self._backlog.forget(record.job_id)
        self._scheduler.drop_provision(record.job_id)  # a gang waiting for new nodes ends
        move(record, end_event(state))
        record.reason = reason
        record.finished_at = now
        compact(record)  # an ended job's workload frees its team's storage (docs/operations.md)
        effects.append(Persist(record))
        event = self.event(record, state, now, reason=reason)
        event.event.accounting = accounting_of(record, now)
        effects.append(event)

    def _end_attempt(
        self, record: JobRecord, attempt: AttemptRecord, cause: str, now: float, *, lost: bool
    ) -> None:
        close_attempt(record, attempt, cause, now, lost=lost)
        self.health.abandoned((attempt.cluster, attempt.flavor), record.job_id, attempt.attempt)
        self._scheduler.release(record.job_id, attempt.attempt)
        self._untrack_live(record, attempt.cluster)
        self._backlog.capacity_dirty = True

    def _requeue(
        self, record: JobRecord, now: float, delay: float, effects: list[Effect], *, reason: str
    ) -> None:
        move(record, Event.REQUEUE)
        record.reason = reason
        self._set_preempting(record, None)
        record.queued_at = now
        record.not_before = now + delay
        self._backlog.enqueue(record)
        effects.append(Persist(record))
        effects.append(self.event(record, "requeued", now, reason=reason))

    def _track_live(self, record: JobRecord, cluster: str) -> None:
        self._live.add(record.job_id)
        self._live_on.setdefault(cluster, set()).add(record.job_id)

    def _untrack_live(self, record: JobRecord, cluster: str) -> None:
        self._live.discard(record.job_id)
        self._starting.discard(record.job_id)
        self._unreported.pop(record.job_id, None)
        jobs = self._live_on.get(cluster)
        if jobs is not None:
            jobs.discard(record.job_id)

    def _cancel(self, record: JobRecord, attempt: AttemptRecord, reason: str) -> Send:
        """The Cancel of an attempt that may still run; the record (persisted by the caller's
        batch) says so until the Cancel is heard (`cancel_settled`)."""
        attempt.cancel_unacked = True
        cmd = Cancel(job_id=record.job_id, epoch=self.epoch, attempt=attempt.attempt, reason=reason)
        return Send(attempt.cluster, cmd)

    def cancel_settled(
        self,
        job_id: str,
        attempt: int,
        now: float,
        cluster: str = "",
        ended: WorkloadStatus | None = None,
    ) -> list[Effect]:
        """The Cancel of `attempt` was acknowledged, or given up on with its cluster lost.
        An acknowledgement may carry the attempt's ending, which `cluster`'s agent had not
        yet seen applied: taken as if its batch had come (a success ends the job, and the
        Cancel of any newer attempt goes out before the Dispatches this Cancel held)."""
        effects: list[Effect] = []
        record = self._jobs.get(job_id)
        old = next((a for a in record.attempts if a.attempt == attempt), None) if record else None
        if record is not None and old is not None and old.cancel_unacked:
            old.cancel_unacked = False
            effects.append(Persist(record))
        if (
            ended is not None
            and ended.phase in TERMINAL_PHASES
            and (ended.job_id, ended.attempt) == (job_id, attempt)
            and old is not None
            and old.cluster == cluster
        ):
            self.workload(cluster, ended, now, effects)
        return effects

    def event(
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


def previous_attempt(record: JobRecord, attempt: AttemptRecord) -> int | None:
    """The number of the attempt dispatched before `attempt`, if any."""
    before = None
    for a in record.attempts:
        if a.attempt >= attempt.attempt:
            break
        before = a.attempt
    return before


def cancels_before(record: JobRecord, attempt: AttemptRecord) -> tuple[int, ...]:
    """The attempts whose Cancels the Dispatch of `attempt` waits for: the one before it, and
    every older one whose Cancel is unacknowledged. Any of them may still run; only the one
    just before would leave an older copy running beside the new one when a dispatch in
    between was given up (its own Cancel heard at once) while the oldest is still unheard."""
    attempts = record.attempts
    if not attempts or (len(attempts) == 1 and attempts[0] is attempt):
        return ()  # a first attempt, the common case
    before = previous_attempt(record, attempt)
    return tuple(
        a.attempt
        for a in record.attempts
        if a.attempt < attempt.attempt and (a.cancel_unacked or a.attempt == before)
    )


def _ended_attempt(record: JobRecord | None, cluster: str, attempt: int) -> AttemptRecord | None:
    """The job's ended attempt `attempt` on `cluster`, if the record holds it."""
    if record is None:
        return None
    return next(
        (
            a
            for a in record.attempts
            if a.attempt == attempt and a.cluster == cluster and not a.live
        ),
        None,
    )


_NONE: frozenset[str] = frozenset()


def _nodes(attempt: AttemptRecord) -> set[str]:
    return {n for a in attempt.assignment for n in a.nodes}


def placement_of_nodes(
    assignment: Sequence[PodSetAssignment],
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((a.podset, tuple(a.nodes)) for a in assignment)


def placement_of(attempt: AttemptRecord) -> Placement:
    return Placement(
        cluster=attempt.cluster,
        flavor=attempt.flavor,
        flavor_class=attempt.flavor_class,
        assignment=placement_of_nodes(attempt.assignment),
    )


def normal_uri(uri: str) -> tuple[str, tuple[str, ...]] | None:
    """A checkpoint URI as (scheme://authority, path segments): percent-decoded until it stops
    changing, the scheme and authority lower-cased, empty segments (duplicate slashes)
    dropped. None for what cannot name a place below a location: a `.` or `..` segment
    (however encoded), a query or fragment, a backslash, or still encoded after four rounds."""
    text = uri
    for _ in range(4):
        decoded = unquote(text)
        if decoded == text:
            break
        text = decoded
    else:
        return None
    if "\\" in text:
        return None
    parts = urlsplit(text)
    if parts.query or parts.fragment:
        return None
    segments = tuple(s for s in parts.path.split("/") if s)
    if any(s in (".", "..") for s in segments):
        return None
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}", segments


def uri_under(uri: str, location: str) -> bool:
    """`uri` is `location` or below it, compared as normalised paths of the same scheme and
    authority (not as strings), so no spelling of `..` lets one job report a checkpoint in
    another job's location."""
    mine, base = normal_uri(uri), normal_uri(location)
    if mine is None or base is None or mine[0] != base[0]:
        return False
    return mine[1][: len(base[1])] == base[1]


def attempt_location(location: str, attempt: int) -> str:
    """Where one attempt writes its checkpoints: its own prefix below the job's location, so
    a late write of an older attempt never lands among a newer attempt's checkpoints."""
    return f"{location.rstrip('/')}/attempt-{attempt}"


def _attempt_of(uri: str, location: str) -> int | None:
    """The attempt whose prefix `uri` lies under (`<location>/attempt-<n>/...`), if any."""
    mine, base = normal_uri(uri), normal_uri(location)
    if mine is None or base is None or len(mine[1]) <= len(base[1]):
        return None
    head = mine[1][len(base[1])]
    digits = head.removeprefix("attempt-")
    return int(digits) if head.startswith("attempt-") and digits.isdigit() else None


def checkpoint_doubt(
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
    if not location:
        return (
            f"job {record.job_id} has no checkpoint.uri, so no checkpoint of it can be "
            "trusted; set checkpoint.uri to where its checkpoints are written"
        )
    if not uri_under(report.uri, location):
        return (
            f"checkpoint {report.uri!r} is not under the job's checkpoint "
            f"location {location!r}; write checkpoints below it"
        )
    other = _attempt_of(report.uri, location) if location else None
    if other is not None and other != report.attempt:
        return (
            f"checkpoint {report.uri!r} is under attempt {other}'s prefix; attempt "
            f"{report.attempt} writes below {attempt_location(location, report.attempt)!r}"
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
