"""Workload status from pods: one `Workload` per (job_id, attempt), fed pod by pod.

Kept free of I/O so the phase rules are tested on their own. Counters are updated per pod
event (no rescans), so a 4,096-replica gang costs O(1) per pod event.

Rules, in order: a cancelled or already-terminal attempt reports nothing more;
any evicted replica -> `evicted` (cause: the pod's DisruptionTarget reason, kubelet
eviction, the node gone, or the pod deleted behind our back); any failed replica -> `failed`
(exit codes and reasons of the failed containers); the leader replica (Master, Launcher,
Chief) succeeded, or every replica succeeded -> `succeeded`; every replica Running ->
`running`; else `created`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from agents.kube.decode import KPod
from agents.kube.manifests import ANN_CHECKPOINT, ANN_JOB, ANN_LEADER, ANN_TOTAL, LABEL_PODSET
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

Kind = str  # "pending" | "running" | "succeeded" | "failed" | "evicted"


class PodView(msgspec.Struct):
    """What one pod contributes to its workload."""

    name: str
    kind: Kind
    node: str = ""
    leader: bool = False
    exit_codes: list[int] = []
    reason: str = ""


class CheckpointAnnotation(msgspec.Struct):
    step: int
    uri: str


_ckpt_decoder = msgspec.json.Decoder(CheckpointAnnotation)


def disruption(pod: KPod) -> str | None:
    """The reason of a True DisruptionTarget condition, if any."""
    for c in pod.status.conditions:
        if c.type == "DisruptionTarget" and c.status == "True":
            return c.reason or "DisruptionTarget"
    return None


def classify(pod: KPod, deleted: bool = False) -> PodView:
    """A pod's contribution: its category, exit codes and the reason to report."""
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


def pod_job(pod: KPod) -> str:
    """The exact job id of a Muster pod (annotation; the label may be a sanitised form)."""
    meta = pod.metadata
    return meta.annotations.get(ANN_JOB) or meta.labels.get("muster.dev/job-id", "")


class Workload:
    """One attempt's objects and pods, and the last phase reported for it."""

    __slots__ = (
        "_views",
        "attempt",
        "cancelled",
        "counts",
        "job_id",
        "kind",
        "last_phase",
        "last_step",
        "leader_succeeded",
        "objects",
        "total",
    )

    def __init__(self, job_id: str, attempt: int, total: int = 0, kind: str = "") -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.total = total
        self.kind = kind
        self.objects: list[tuple[str, str]] = []  # (collection path, name)
        self._views: dict[str, PodView] = {}
        self.counts: dict[Kind, int] = {
            "pending": 0,
            "running": 0,
            "succeeded": 0,
            "failed": 0,
            "evicted": 0,
        }
        self.leader_succeeded = 0
        self.last_phase: WorkloadPhase | None = None
        self.last_step: int | None = None
        self.cancelled = False

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
        self._views[uid] = view
        self.counts[view.kind] += 1
        if view.leader and view.kind == "succeeded":
            self.leader_succeeded += 1

    def node_gone(self, node: str) -> bool:
        """Mark replicas on a deleted node evicted; True when one was."""
        hit = False
        for uid, v in self._views.items():
            if v.node == node and v.kind in ("pending", "running"):
                self.counts[v.kind] -= 1
                self._views[uid] = PodView(
                    v.name, "evicted", node, v.leader, reason=f"node gone: {node}"
                )
                self.counts["evicted"] += 1
                hit = True
        return hit

    def pod_names(self) -> list[str]:
        return [v.name for v in self._views.values()]

    @property
    def nodes(self) -> list[str]:
        return sorted({v.node for v in self._views.values() if v.node})

    # -- phase --------------------------------------------------------------------------
    def phase(self) -> tuple[WorkloadPhase, str, list[int]]:
        c = self.counts
        if c["evicted"]:
            reason = next(v.reason for v in self._views.values() if v.kind == "evicted")
            return "evicted", reason, []
        if c["failed"]:
            codes: list[int] = []
            reasons: list[str] = []
            for v in self._views.values():
                if v.kind == "failed":
                    codes.extend(v.exit_codes)
                    reasons.append(v.reason)
            return "failed", "; ".join(reasons)[:1024], codes[:_MAX_EXIT_CODES]
        if self.leader_succeeded or (self.total and c["succeeded"] >= self.total):
            return "succeeded", "", []
        if self.total and c["running"] + c["succeeded"] >= self.total and c["running"]:
            return "running", "", []
        return "created", "", []

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
        Phases only move forward (created -> running -> terminal)."""
        if self.cancelled or self.terminal:
            return None
        st = self.status()
        if st.phase == self.last_phase:
            return None
        if st.phase == "created" and self.last_phase == "running":
            return None  # a replica restarting is not a new attempt
        self.last_phase = st.phase
        return st

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
        if self.last_step is not None and ck.step <= self.last_step:
            return None
        self.last_step = ck.step
        return CheckpointReport(
            job_id=self.job_id, attempt=self.attempt, step=ck.step, uri=ck.uri, at=clock()
        )


def podset_of(pod: KPod) -> str:
    return pod.metadata.labels.get(LABEL_PODSET, "")
