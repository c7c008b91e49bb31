"""Workload status: one `Workload` per (job_id, attempt), fed pod by pod and by the verdicts
of the workload objects Muster created (the Job, PyTorchJob, JobSet, ...).

Kept free of I/O so the phase rules are tested on their own. Counters are updated per event
(no rescans), so a 4,096-replica gang costs O(1) per pod event; reasons and exit codes are only
assembled when a transition is emitted.

Why objects as well as pods: an operator can give up while every pod still runs (Kubeflow's
backoffLimit with `restartPolicy: OnFailure` counts in-place container restarts; batch/v1
`activeDeadlineSeconds`), and it can succeed after its pods are gone (cleanPodPolicy, JobSet
success policies). `job_verdict` reads that from `status.conditions` (batch/v1 `Complete`,
`SuccessCriteriaMet`, `Failed`, `FailureTarget`; Kubeflow `Succeeded`, `Failed`; JobSet
`Completed`, `Failed`) or Volcano's `status.state.phase`. In-place restarts are read from the
pods' `restartCount` and `lastState.terminated`; they are no phase of their own but their exit
codes and a note ("pod-1 restarted 3 times (exit 137 OOMKilled)") ride on the next transition.

Rules, in order: a cancelled or already-terminal attempt reports nothing more;
any evicted replica -> `evicted` (cause: the pod's DisruptionTarget reason, kubelet
eviction, the node gone, or the pod deleted behind our back); any failed replica or any object
failed -> `failed` (exit codes and reasons of the failed containers, the object's condition);
the leader replica (Master, Launcher, Chief) succeeded, every replica succeeded, or every
object of the attempt succeeded -> `succeeded`; every replica Running -> `running`; else
`created`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from agents.kube.decode import KJobStatus, KPod
from kinds.base import (
    ANN_CHECKPOINT,
    ANN_JOB,
    ANN_LEADER,
    ANN_TOTAL,
    LABEL_JOB,
    KindError,
    clip,
)
from kinds.registry import STATUS_RESOURCES, adapter_for
from schemas.agent import CheckpointReport, WorkloadPhase, WorkloadStatus

# Pod `status.reason` values that mean the pod was pushed off, not that the job failed.
EVICTION_REASONS = frozenset(
    {"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown", "Terminated"}
)
DISRUPTION_CAUSES = {
    "PreemptionByScheduler": "preempted by the scheduler",
    "DeletionByTaintManager": "node taint (NoExecute)",
    "EvictionByEvictionAPI": "evicted through the eviction API (drain)",
    "DeletionByPodGC": "pod garbage-collected (node gone)",
    "TerminationByKubelet": "node shutting down",
}
_MAX_EXIT_CODES = 4096
_MAX_POD_CODES = 16  # distinct restart exit codes kept per pod
_MAX_RESTART_NOTES = 8

__all__ = ["STATUS_RESOURCES"]  # re-exported: the backend watches these

Kind = str  # "pending" | "running" | "succeeded" | "failed" | "evicted"


class PodView(msgspec.Struct):
    """What one pod contributes to its workload."""

    name: str
    kind: Kind
    node: str = ""
    leader: bool = False
    exit_codes: list[int] = []
    reason: str = ""
    restarts: int = 0  # in-place container restarts (restartCount, summed)
    restart_codes: list[int] = []  # distinct non-zero exit codes of those restarts
    restart_note: str = ""  # "pod restarted 3 times (exit 137 OOMKilled)"


class JobVerdict(msgspec.Struct, frozen=True):
    """How a workload object ended, by its own status."""

    phase: WorkloadPhase  # "succeeded" | "failed"
    reason: str


class CheckpointAnnotation(msgspec.Struct):
    """The `muster.dev/checkpoint` annotation. `job_id`/`attempt` name the attempt that wrote
    it; when given they must be the pod's own, so a pod cannot report for another attempt."""

    step: int
    uri: str
    job_id: str = ""
    attempt: int = 0


_ckpt_decoder = msgspec.json.Decoder(CheckpointAnnotation)


def disruption(pod: KPod) -> str | None:
    """The reason of a True DisruptionTarget condition, if any."""
    for c in pod.status.conditions:
        if c.type == "DisruptionTarget" and c.status == "True":
            return c.reason or "DisruptionTarget"
    return None


def restarts(pod: KPod) -> tuple[int, list[int], str]:
    """In-place restarts of a pod's containers: (total restartCount, non-zero exit codes of
    the last terminations, a note such as "worker-1 restarted 3 times (exit 137 OOMKilled)")."""
    st = pod.status
    restarted = [
        cs for cs in (*st.initContainerStatuses, *st.containerStatuses) if cs.restartCount > 0
    ]
    if not restarted:
        return 0, [], ""
    total = 0
    codes: list[int] = []
    notes: list[str] = []
    name = pod.metadata.name
    for cs in restarted:
        total += cs.restartCount
        who = name if len(restarted) == 1 else f"{name}/{cs.name}"
        times = "once" if cs.restartCount == 1 else f"{cs.restartCount} times"
        term = cs.lastState.terminated
        detail = ""
        if term is not None:
            if term.exitCode != 0 and term.exitCode not in codes:
                codes.append(term.exitCode)
            detail = f" (exit {term.exitCode}{' ' + term.reason if term.reason else ''})"
        notes.append(f"{who} restarted {times}{detail}")
    return total, codes, ", ".join(notes)


def classify(pod: KPod, deleted: bool = False) -> PodView:
    """A pod's contribution: its category, exit codes and the reason to report."""
    view = _classify(pod, deleted)
    if pod.status.containerStatuses or pod.status.initContainerStatuses:
        view.restarts, view.restart_codes, view.restart_note = restarts(pod)
    return view


def _classify(pod: KPod, deleted: bool) -> PodView:
    st = pod.status
    meta = pod.metadata
    leader = meta.annotations.get(ANN_LEADER) == "true"
    node = pod.spec.nodeName
    dis = disruption(pod)
    if st.phase == "Succeeded":
        return PodView(meta.name, "succeeded", node, leader)
    if st.phase == "Failed":
        if st.reason in EVICTION_REASONS or dis is not None:
            cause = DISRUPTION_CAUSES.get(dis or "", dis or st.reason)
            msg = f": {st.message}" if st.message else ""
            return PodView(meta.name, "evicted", node, leader, reason=f"{cause}{msg}")
        codes: list[int] = []
        reasons: list[str] = []
        for cs in (*st.initContainerStatuses, *st.containerStatuses):
            term = cs.state.terminated
            if term is not None and term.exitCode != 0:
                codes.append(term.exitCode)
                reasons.append(f"{cs.name}: {term.reason or 'Error'} ({term.exitCode})")
        reason = "; ".join(reasons) or st.reason or st.message or "pod failed"
        return PodView(meta.name, "failed", node, leader, codes, f"pod {meta.name}: {reason}")
    if deleted:
        cause = DISRUPTION_CAUSES.get(dis or "", dis or "pod deleted")
        return PodView(meta.name, "evicted", node, leader, reason=f"pod {meta.name}: {cause}")
    return PodView(meta.name, "running" if st.phase == "Running" else "pending", node, leader)


def job_verdict(api_version: str, kind: str, name: str, status: KJobStatus) -> JobVerdict | None:
    """The verdict of a workload object from its status (its kind's adapter reads it), or None
    while it is undecided."""
    try:
        adapter = adapter_for(api_version, kind)
    except KindError:
        return None
    found = adapter.verdict(name, msgspec.to_builtins(status))
    if found is None:
        return None
    phase: WorkloadPhase = "succeeded" if found.phase == "succeeded" else "failed"
    return JobVerdict(phase, found.reason)


def pod_job(pod: KPod) -> str:
    """The exact job id of a Muster pod (annotation; the label may be a sanitised form)."""
    meta = pod.metadata
    return meta.annotations.get(ANN_JOB) or meta.labels.get(LABEL_JOB, "")


class Refs(list[tuple[str, str]]):
    """An attempt's objects, (collection path, name), in creation order and without repeats,
    with O(1) membership: a Pod-kind gang has one object per pod, and every object seen in a
    list or an event is checked against it."""

    def __init__(self) -> None:
        super().__init__()
        self._known: set[tuple[str, str]] = set()

    def append(self, ref: tuple[str, str]) -> None:
        if ref not in self._known:
            self._known.add(ref)
            super().append(ref)

    def __contains__(self, ref: object) -> bool:
        return ref in self._known


class Workload:
    """One attempt's objects and pods, and the last phase reported for it."""

    __slots__ = (
        "_verdicts",
        "_views",
        "attempt",
        "cancelled",
        "complete",
        "counts",
        "creating",
        "job_id",
        "jobs_failed",
        "jobs_succeeded",
        "kind",
        "last_phase",
        "last_step",
        "leader_succeeded",
        "namespace",
        "objects",
        "reported_restarts",
        "restarted_pods",
        "restarts",
        "token_digest",
        "total",
    )

    def __init__(self, job_id: str, attempt: int, total: int = 0, kind: str = "") -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.total = total
        self.kind = kind
        self.namespace = ""  # where its objects and pods are ("" = not yet known)
        self.objects = Refs()  # (collection path, name)
        # Every object of its plan was created or adopted by this agent instance, so
        # `objects` is all of it there is (`WorkloadObjects.known_in_full`).
        self.complete = False
        # Its Dispatch is being carried out here: no phase goes out before that ends, since
        # the broker reads "created" as the Dispatch done (broker/ackwait.py), and a watch
        # sees the first object while the rest wait for the API budget.
        self.creating = False
        self._views: dict[str, PodView] = {}
        self.counts: dict[Kind, int] = {
            "pending": 0,
            "running": 0,
            "succeeded": 0,
            "failed": 0,
            "evicted": 0,
        }
        self.leader_succeeded = 0
        self.restarted_pods = 0
        self.restarts = 0  # in-place container restarts over all replicas
        self.reported_restarts = 0  # ... as of the last status emitted
        # Objects with a status (Job, PyTorchJob, ...): (collection, name) -> verdict or None.
        self._verdicts: dict[tuple[str, str], JobVerdict | None] = {}
        self.jobs_succeeded = 0
        self.jobs_failed = 0
        self.last_phase: WorkloadPhase | None = None
        self.last_step: int | None = None
        self.cancelled = False
        # sha256 of the attempt's checkpoint token (kinds.pods.token_digest); "" = unknown
        self.token_digest = ""

    # -- pods ---------------------------------------------------------------------------
    def update_pod(self, uid: str, pod: KPod, deleted: bool = False) -> None:
        if not self.total:
            raw = pod.metadata.annotations.get(ANN_TOTAL, "")
            self.total = int(raw) if raw.isdigit() else 0
        old = self._views.get(uid)
        if deleted and old is not None and old.kind in ("succeeded", "failed", "evicted"):
            return  # a finished pod being cleaned up changes nothing
        view = classify(pod, deleted)
        if old is not None:
            self.counts[old.kind] -= 1
            if old.leader and old.kind == "succeeded":
                self.leader_succeeded -= 1
            if old.restarts:
                self.restarted_pods -= 1
                self.restarts -= old.restarts
                _keep_restarts(old, view)
        self._views[uid] = view
        self.counts[view.kind] += 1
        if view.leader and view.kind == "succeeded":
            self.leader_succeeded += 1
        if view.restarts:
            self.restarted_pods += 1
            self.restarts += view.restarts

    def node_gone(self, node: str) -> bool:
        """Mark replicas on a deleted node evicted; True when one was."""
        hit = False
        for uid, v in self._views.items():
            if v.node == node and v.kind in ("pending", "running"):
                self.counts[v.kind] -= 1
                self._views[uid] = msgspec.structs.replace(
                    v, kind="evicted", exit_codes=[], reason=f"node gone: {node}"
                )
                self.counts["evicted"] += 1
                hit = True
        return hit

    @property
    def nodes(self) -> list[str]:
        return sorted({v.node for v in self._views.values() if v.node})

    # -- objects ------------------------------------------------------------------------
    def expect_object(self, ref: tuple[str, str]) -> None:
        """An object of this attempt whose status will be watched (undecided until seen)."""
        if ref not in self._verdicts:
            self._verdicts[ref] = None

    def update_object(self, ref: tuple[str, str], verdict: JobVerdict | None) -> None:
        """The verdict an object's status gives now (None: undecided)."""
        old = self._verdicts.get(ref)
        if old is not None:
            if old.phase == "failed":
                self.jobs_failed -= 1
            else:
                self.jobs_succeeded -= 1
        self._verdicts[ref] = verdict
        if verdict is not None:
            if verdict.phase == "failed":
                self.jobs_failed += 1
            else:
                self.jobs_succeeded += 1

    # -- phase --------------------------------------------------------------------------
    def current_phase(self) -> WorkloadPhase:
        """The phase by the rules of the module docstring, in O(1)."""
        c = self.counts
        if c["evicted"]:
            return "evicted"
        if c["failed"] or self.jobs_failed:
            return "failed"
        if (
            self.leader_succeeded
            or (self.total and c["succeeded"] >= self.total)
            or (self._verdicts and self.jobs_succeeded == len(self._verdicts))
        ):
            return "succeeded"
        if self.total and c["running"] + c["succeeded"] >= self.total and c["running"]:
            return "running"
        return "created"

    def phase(self) -> tuple[WorkloadPhase, str, list[int]]:
        """The phase with its reason and exit codes (O(replicas): built for emission only).
        Once a terminal phase was reported it stays (later pod clean-up changes nothing)."""
        phase = self.last_phase if self.terminal and self.last_phase else self.current_phase()
        reasons: list[str] = []
        codes: list[int] = []
        if phase == "evicted":
            reasons.append(next(v.reason for v in self._views.values() if v.kind == "evicted"))
        elif phase == "failed":
            for v in self._views.values():
                if v.kind == "failed":
                    codes.extend(v.exit_codes)
                    reasons.append(v.reason)
            reasons.extend(
                j.reason for j in self._verdicts.values() if j is not None and j.phase == "failed"
            )
        if self.restarted_pods:
            pods = sorted(
                (v for v in self._views.values() if v.restarts), key=lambda v: -v.restarts
            )
            for v in pods:
                codes.extend(c for c in v.restart_codes if c not in codes)
            notes = [v.restart_note for v in pods[:_MAX_RESTART_NOTES]]
            if len(pods) > _MAX_RESTART_NOTES:
                notes.append(f"{len(pods) - _MAX_RESTART_NOTES} more pods restarted")
            reasons.append("; ".join(notes))
        return phase, clip("; ".join(r for r in reasons if r)), codes[:_MAX_EXIT_CODES]

    def status(self) -> WorkloadStatus:
        phase, reason, codes = self.phase()
        return WorkloadStatus(
            job_id=self.job_id,
            attempt=self.attempt,
            phase=phase,
            running_replicas=self.counts["running"],
            total_replicas=self.total,
            exit_codes=codes,
            reason=reason,
            step=self.last_step,
            nodes=self.nodes[:4096],
        )

    @property
    def terminal(self) -> bool:
        return self.last_phase in ("succeeded", "failed", "evicted")

    def transition(self) -> WorkloadStatus | None:
        """The status to emit when the phase moved forward since the last report, else None.
        Phases only move forward (created -> running -> terminal). A running attempt whose
        containers restarted in place since the last report says so again (`running` with the
        restart note), so a crash loop shows before the operator gives up."""
        if self.cancelled or self.terminal:
            return None
        phase = self.current_phase()
        if phase == self.last_phase:
            if phase != "running" or self.restarts <= self.reported_restarts:
                return None
        elif phase == "created" and self.last_phase == "running":
            return None  # a replica restarting is not a new attempt
        self.last_phase = phase
        self.reported_restarts = self.restarts
        return self.status()

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(
        self, pod: KPod, clock: Callable[[], float] = time.time
    ) -> CheckpointReport | None:
        """A CheckpointReport when the pod's `muster.dev/checkpoint` annotation names a step
        newer than the last one reported for this attempt."""
        raw = pod.metadata.annotations.get(ANN_CHECKPOINT)
        if not raw:
            return None
        try:
            ck = _ckpt_decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        if ck.step < 0 or not ck.uri or len(ck.uri) > 2048:
            return None
        if (ck.job_id and ck.job_id != self.job_id) or (ck.attempt and ck.attempt != self.attempt):
            return None  # written for another attempt: not this pod's to report
        return self.accept_checkpoint(ck.step, ck.uri, clock)

    def accept_checkpoint(
        self, step: int, uri: str, clock: Callable[[], float] = time.time
    ) -> CheckpointReport | None:
        """The one place a checkpoint of this attempt becomes an event, whichever route it
        came by (pod annotation, report endpoint): only a step newer than the last one."""
        if self.last_step is not None and step <= self.last_step:
            return None
        self.last_step = step
        return CheckpointReport(
            job_id=self.job_id, attempt=self.attempt, step=step, uri=uri, at=clock()
        )


def _keep_restarts(old: PodView, new: PodView) -> None:
    """Carry restart history across a pod's updates: exit codes seen earlier stay, and a
    deleted pod's stub (no container statuses) keeps the last counts."""
    if old.restart_codes:
        merged = [*old.restart_codes, *(c for c in new.restart_codes if c not in old.restart_codes)]
        new.restart_codes = merged[:_MAX_POD_CODES]
    if old.restarts > new.restarts:
        new.restarts, new.restart_note = old.restarts, old.restart_note
