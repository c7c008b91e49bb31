"""Attempt status from what the watches see: Muster's pods and its workload objects.

Each attempt Muster runs here has one `status.Workload`, found by (job id, attempt) from its
pods' labels or its objects' annotation and labels, in a workload namespace only (a label in
another namespace cannot fake a status). `Attempts` keeps them, with which pods belong to
which attempt and which attempts were cancelled, and does no I/O. `AttemptWatch` takes what
the watches of Muster's pods and objects deliver, records it there and sends each transition.

What is sent: `WorkloadStatus` on each phase transition of an attempt (see `status.py`: pods,
object verdicts, in-place container restarts), and `CheckpointReport` when a pod's
`muster.dev/checkpoint` annotation (JSON `{"step": int, "uri": str}`) names a newer step. A
workload may also post a checkpoint to the agent's report endpoint (`report.py`,
`MUSTER_REPORT_URL` on every replica, authenticated by the attempt's `MUSTER_CHECKPOINT_TOKEN`;
no RBAC; `accept_report`), or publish `muster.checkpoint.<job_id>`.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection, Container, Mapping
from typing import Any

from agents.kube.client import Pacer
from agents.kube.decode import KJob, KMeta, KPod, decode_job_status
from agents.kube.report import Refused, ReportBody, Verdict
from agents.kube.status import Workload, job_verdict, pod_job
from kinds.base import (
    ANN_JOB,
    ANN_KIND,
    ANN_TOKEN_DIGEST,
    ANN_TOTAL,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_TOP,
    Resource,
)
from kinds.pods import token_digest
from schemas.agent import AgentEvent, CheckpointReport, Dispatch, WorkloadStatus

Key = tuple[str, int]  # (job_id, attempt)


def owned_key(meta: KMeta) -> Key | None:
    """(job_id, attempt) of an object Muster created: the exact id from the annotation (the
    label may be a sanitised form), the attempt from its label; None when not Muster's."""
    job_id = meta.annotations.get(ANN_JOB) or meta.labels.get(LABEL_JOB, "")
    raw = meta.labels.get(LABEL_ATTEMPT, "")
    if not job_id or LABEL_JOB not in meta.labels or not raw.isdigit() or int(raw) < 1:
        return None
    return (job_id, int(raw))


class Attempts:
    """The attempts known here, by (job id, attempt), and their pods."""

    def __init__(
        self,
        namespaces: Container[str],
        status_kinds: Mapping[str, Resource],
        clock: Callable[[], float],
        log: Any,
    ) -> None:
        self.namespaces = namespaces
        self.status_kinds = status_kinds  # workload objects with a status, by collection
        self.clock = clock
        self.log = log
        self.workloads: dict[Key, Workload] = {}
        self.pod_key: dict[str, Key] = {}  # Muster pod uid -> workload
        self.pod_names: dict[Key, dict[str, str]] = {}  # workload -> {uid: pod name}
        # Cancelled attempts, so pods seen after the cancel never report a status.
        self.cancelled: set[Key] = set()
        self.cancel_upto: dict[str, float] = {}  # job -> every attempt <= this is cancelled
        self.bad_objects = 0  # workload objects whose status did not decode

    def is_cancelled(self, key: Key) -> bool:
        return key in self.cancelled or key[1] <= self.cancel_upto.get(key[0], 0)

    def dispatched(self, cmd: Dispatch, total: int, ns: str) -> Workload:
        """The attempt is being created in `ns` with `total` replicas: its Workload, no longer
        cancelled (a cancel of a whole job covers its attempts up to this one's)."""
        key = (cmd.job_id, cmd.attempt)
        w = self.workloads.get(key)
        if w is None:
            w = self.workloads[key] = Workload(
                cmd.job_id, cmd.attempt, total, cmd.spec.workload.kind
            )
        w.total = total
        w.namespace = ns
        if cmd.checkpoint_token:
            w.token_digest = token_digest(cmd.checkpoint_token)
        w.cancelled = False
        self.cancelled.discard(key)
        if key[0] in self.cancel_upto:
            self.cancel_upto[key[0]] = min(self.cancel_upto[key[0]], cmd.attempt - 1)
        return w

    def namespace_of(self, key: Key, default: str) -> str:
        """Where an attempt's pods are: where it was seen, else `default`."""
        w = self.workloads.get(key)
        return w.namespace if w is not None and w.namespace else default

    def workload(self, key: Key, meta: KMeta) -> Workload:
        """The attempt's Workload, created from a top-level object's annotations if new."""
        w = self.workloads.get(key)
        if w is None:
            total = meta.annotations.get(ANN_TOTAL, "")
            w = self.workloads[key] = Workload(
                key[0],
                key[1],
                int(total) if total.isdigit() else 0,
                meta.annotations.get(ANN_KIND, ""),
            )
            w.cancelled = self.is_cancelled(key)
        w.namespace = w.namespace or meta.namespace
        return w

    def found_object(self, key: Key, collection: str, meta: KMeta) -> None:
        """An object of the attempt exists (a scan found it)."""
        w = self.workload(key, meta)
        if (collection, meta.name) not in w.objects:
            w.objects.append((collection, meta.name))
        if collection in self.status_kinds:
            w.expect_object((collection, meta.name))

    def job_event(self, res: Resource, kind: str, obj: KJob) -> Workload | None:
        """One of Muster's workload objects changed: record its verdict for the attempt, whose
        Workload is returned to report. Same ownership rules as pods (workload namespace,
        Muster's labels)."""
        meta = obj.metadata
        key = owned_key(meta)
        if (
            key is None
            or not meta.name
            or meta.namespace not in self.namespaces
            or LABEL_TOP not in meta.labels
        ):
            return None
        if kind == "DELETED" and key not in self.workloads:
            return None  # an attempt already forgotten (finished, collected): nothing to say
        w = self.workload(key, meta)
        ref = (res.collection(meta.namespace), meta.name)
        if ref not in w.objects:
            w.objects.append(ref)
        w.expect_object(ref)
        status = decode_job_status(obj.status)
        if status is None:
            self.bad_objects += 1
            if self.bad_objects & (self.bad_objects - 1) == 0:  # 1st, 2nd, 4th, ...: no flood
                self.log.warning(
                    "workload object with an undecodable status ignored",
                    kind=res.kind,
                    name=meta.name,
                    status=bytes(obj.status)[:200],
                    count=self.bad_objects,
                )
            return None
        w.update_object(ref, job_verdict(res.api_version, res.kind, meta.name, status))
        return w

    def muster_pod(
        self, uid: str, pod: KPod, deleted: bool, gone_nodes: Container[str]
    ) -> tuple[Workload, CheckpointReport | None] | None:
        """One of Muster's pods changed: the attempt's Workload to report, and a checkpoint
        its annotation reports, if new. None for a pod without a valid attempt label."""
        meta = pod.metadata
        job_id = pod_job(pod)
        raw_attempt = meta.labels.get(LABEL_ATTEMPT, "")
        if not job_id or not raw_attempt.isdigit() or int(raw_attempt) < 1:
            return None
        key = (job_id, int(raw_attempt))
        w = self.workloads.get(key)
        if w is None:
            kind = meta.annotations.get(ANN_KIND, "")
            w = self.workloads[key] = Workload(job_id, key[1], kind=kind)
            w.cancelled = self.is_cancelled(key)
        w.namespace = w.namespace or meta.namespace
        w.update_pod(uid, pod, deleted)
        if not w.token_digest:  # an agent restarted since the dispatch: the pods keep it
            w.token_digest = meta.annotations.get(ANN_TOKEN_DIGEST, "")
        if pod.spec.nodeName in gone_nodes:
            w.node_gone(pod.spec.nodeName)
        names = self.pod_names.setdefault(key, {})
        if deleted:
            self.pod_key.pop(uid, None)
            names.pop(uid, None)
        else:
            self.pod_key[uid] = key
            names[uid] = meta.name
        return w, w.checkpoint(pod, self.clock) if not w.cancelled else None

    def forget_pod(self, uid: str) -> Workload | None:
        """A Muster pod vanished between lists: it counts as deleted; its Workload, if any,
        is returned to report."""
        key = self.pod_key.pop(uid, None)
        if key is None:
            return None
        w = self.workloads.get(key)
        names = self.pod_names.get(key, {})
        name = names.pop(uid, "")
        if w is None:
            return None
        stub = KPod()
        stub.metadata.name = name
        w.update_pod(uid, stub, deleted=True)
        return w

    def accept_report(
        self, report: ReportBody, cluster: str
    ) -> tuple[Verdict, CheckpointReport | None]:
        """A checkpoint report a pod posted (agents/kube/report.py): taken only for an
        attempt running here, with that attempt's token; a refusal changes nothing."""
        job, attempt = report.job_id, report.attempt
        if not report.token:
            raise Refused(
                401,
                "no token: send this pod's MUSTER_CHECKPOINT_TOKEN (the SDK does when it "
                "runs with the pod's environment)",
            )
        w = self.workloads.get((job, attempt))
        if w is None:
            raise Refused(
                404,
                f"job {job} attempt {attempt} does not run on cluster {cluster}; report "
                "from the attempt's own pods with their MUSTER_* environment",
            )
        if not w.token_digest:
            raise Refused(
                403,
                f"job {job} attempt {attempt} was dispatched without a checkpoint token, so "
                "no report for it can be checked here; use the pod annotation route",
            )
        if not hmac.compare_digest(token_digest(report.token), w.token_digest):
            raise Refused(
                403,
                f"the token is not the one of job {job} attempt {attempt}; only that "
                "attempt's own pods (their MUSTER_CHECKPOINT_TOKEN) may report for it",
            )
        if w.cancelled or w.terminal:
            ended = "was cancelled or moved" if w.cancelled else f"has {w.last_phase}"
            raise Refused(
                409,
                f"job {job} attempt {attempt} {ended}; its checkpoints are no longer "
                "taken (the running attempt reports its own)",
            )
        event = w.accept_checkpoint(report.step, report.uri, self.clock)
        if event is None:
            return Verdict(200, f"step {report.step} is not newer than step {w.last_step}"), None
        return Verdict(200, f"step {report.step} recorded", recorded=True), event


class AttemptWatch:
    """Muster's pods and workload objects as their watches deliver them: each change is
    recorded in `attempts` and the attempt's transition, if any, sent. Before the first
    snapshot (not `live`) a phase is remembered as reported, not sent."""

    def __init__(
        self,
        attempts: Attempts,
        namespaces: Collection[str],
        gone_nodes: Container[str],
        log: Any,
        send: Callable[[AgentEvent], None],
        live: Callable[[], bool],
        pods: Callable[[], Mapping[str, KPod]],
        note_disruption: Callable[[str, KPod, bool], None],
        hold: Callable[[str, KPod, bool], None],
        forget_held: Callable[[str], None],
        ended: Callable[[Workload, WorkloadStatus], None],
    ) -> None:
        self.attempts = attempts
        self.namespaces = namespaces
        self.gone_nodes = gone_nodes  # recently deleted nodes
        self.log = log
        self._send = send
        self._live = live
        self._pods = pods  # Muster's pods as last seen, by uid
        self._note_disruption = note_disruption  # a pod's DisruptionTarget, for its node
        self._hold = hold  # what a pod of an ended attempt still holds on its node
        self._forget_held = forget_held  # a pod is gone: it holds nothing, disrupts nothing
        self._ended = ended  # an attempt reached a terminal phase

    def node_gone(self, name: str) -> None:
        """A node was deleted: the replicas there are lost."""
        for w in self.attempts.workloads.values():
            if w.node_gone(name):
                self.report(w)

    async def replace_pods(self, items: list[KPod]) -> None:
        """A (re-)list of Muster's pods: each recorded, and those it lacks forgotten."""
        pacer = Pacer()
        seen = set()
        async for pod in pacer.each(items):
            if pod.metadata.uid:
                seen.add(pod.metadata.uid)
                self.pod_event("MODIFIED", pod)
        async for uid in pacer.each([u for u in self.attempts.pod_key if u not in seen]):
            self.forget_pod(uid)

    def forget_pod(self, uid: str) -> None:
        """A Muster pod vanished between lists: drop what it held; it counts as deleted."""
        self._forget_held(uid)
        w = self.attempts.forget_pod(uid)
        if w is not None:
            self.report(w)

    def pod_event(self, kind: str, pod: KPod) -> None:
        """One of Muster's pods changed, in any phase (a failed pod's exit codes are its
        verdict)."""
        meta = pod.metadata
        if meta.namespace and meta.namespace not in self.namespaces:
            return  # a label outside the workload namespaces fakes no status
        uid = meta.uid or f"{meta.namespace}/{meta.name}"
        deleted = kind == "DELETED"
        self._note_disruption(uid, pod, deleted)
        self._muster_pod(uid, pod, deleted)

    def _muster_pod(self, uid: str, pod: KPod, deleted: bool) -> None:
        found = self.attempts.muster_pod(uid, pod, deleted, self.gone_nodes)
        if found is None:
            return
        w, report = found
        if report is not None:
            self._send(report)
        self.report(w)
        self._hold(uid, pod, deleted)

    def report(self, w: Workload) -> None:
        """Send the attempt's transition, if its phase changed since the last one sent; not
        while its Dispatch is still creating its objects (the report after that sends it)."""
        if w.creating:
            return
        if not self._live():
            # Before the first snapshot the phase is not "news"; remember it as reported.
            if not w.cancelled and not w.terminal:
                w.last_phase = w.current_phase()
            return
        st = w.transition()
        if st is not None:
            self.log.info(
                "workload", job_id=w.job_id, attempt=w.attempt, phase=st.phase, reason=st.reason
            )
            self._send(st)
            if w.terminal:
                self.hold_all((w.job_id, w.attempt))
                self._ended(w, st)

    def job_replacer(self, res: Resource) -> Callable[[list[KJob]], Awaitable[None]]:
        async def replace(items: list[KJob]) -> None:
            # Objects gone between lists keep the verdict last seen: a finished attempt's
            # object may be deleted, and a live one's deletion shows in its pods.
            async for obj in Pacer().each(items):
                self.job_event(res, "MODIFIED", obj)

        return replace

    def job_handler(self, res: Resource) -> Callable[[str, KJob], None]:
        def handle(kind: str, obj: KJob) -> None:
            self.job_event(res, kind, obj)

        return handle

    def job_event(self, res: Resource, kind: str, obj: KJob) -> None:
        """One of Muster's workload objects changed (`Attempts.job_event`): report it."""
        w = self.attempts.job_event(res, kind, obj)
        if w is not None:
            self.report(w)

    def hold_all(self, key: Key) -> None:
        """The attempt ended here: its pods still running or terminating keep their GPUs."""
        cache = self._pods()
        for uid in list(self.attempts.pod_names.get(key, {})):
            pod = cache.get(uid)
            if pod is not None:
                self._hold(uid, pod, False)
