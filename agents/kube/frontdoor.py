"""The Kubernetes front door: `kubectl apply` of a marked, suspended workload submits it.

The user's object (the "home object") stays in the home cluster, suspended, as the user's
handle, as MultiKueue keeps a manager cluster's Job: Muster runs a copy wherever the broker
places it (the home cluster included: the copy is made like anywhere else, so placement, fencing
and garbage collection stay one code path). The agent mirrors what Muster decided back onto the
home object (a condition or annotations, and Events) and cancels the job when the object is
deleted (a finalizer holds it until the broker was told).

Level-triggered: every `poll_s` the agent lists the marked objects of the configured namespaces
and brings each to where its annotations say it should be, so an agent restart picks up where
the last one stopped. The job id is a function of the object's UID (and of its spec, once the
spec was edited), so a re-apply or a restart never makes a second job: the broker answers a known
job id as a duplicate. See docs/kubernetes.md, "Submitting with kubectl".
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import structlog
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from agents.config import FrontDoorConfig, FrontDoorNamespace
from agents.kube.client import MERGE_PATCH, KubeApiError, KubeRest, item_path, sleep_or_stop
from kinds.adapter import Adapter
from kinds.base import ANN_JOB as ANN_JOB_ID
from kinds.base import DOMAIN, LABEL_JOB, LABEL_TOP, POD, Resource
from kinds.registry import ADAPTERS
from schemas.api import ApiReply, CancelRequest, JobEvent, JobRef, JobView, SubmitReply
from schemas.codec import (
    DecodeError,
    decode_job_event,
    decode_submit_reply,
    encode_json,
    json_decoder,
)
from schemas.subjects import Subjects
from shell.natsio import submit_request

log = structlog.get_logger("muster.agent.frontdoor")

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # as the broker reads it (broker/manifests.py)
MUSTER_QUEUE_LABEL = f"{DOMAIN}/queue"
QUEUE_LABELS = (KUEUE_QUEUE_LABEL, MUSTER_QUEUE_LABEL)
FINALIZER = f"{DOMAIN}/frontdoor"
ANN_PREFIX = f"{DOMAIN}/frontdoor-"
ANN_JOB = f"{ANN_PREFIX}job-id"  # the job submitted for the object's current spec
ANN_SPEC = f"{ANN_PREFIX}spec"  # hash of the spec that job runs
ANN_STATE = f"{ANN_PREFIX}state"  # the condition's reason, for every kind
ANN_MESSAGE = f"{ANN_PREFIX}message"
ANN_CLUSTER = f"{ANN_PREFIX}cluster"
CONDITION = "MusterAdmitted"
COMPONENT = "muster-frontdoor"
_decode_view = json_decoder(ApiReply[JobView], "reply")


class Suspend(NamedTuple):
    """Where a kind keeps its suspend flag (None: the kind has none)."""

    path: tuple[str, ...] | None
    conditions: bool  # its status schema takes a foreign condition type


def suspend_of(resource: Resource) -> Suspend:
    """Per kind. Conditions go where the status schema types `conditions[].type` as a free
    string (the Kubeflow CRDs, JobSet, TrainJob); a batch/v1 Job's conditions belong to the Job
    controller, whose status updates the API server validates, and Volcano's and Ray's status
    have no typed conditions: those get the annotations only."""
    group = resource.api_version.rpartition("/")[0]
    if group == "kubeflow.org":
        return Suspend(("spec", "runPolicy", "suspend"), True)
    if group in ("jobset.x-k8s.io", "trainer.kubeflow.org"):
        return Suspend(("spec", "suspend"), True)
    if group in ("batch", "ray.io"):
        return Suspend(("spec", "suspend"), False)
    return Suspend(None, False)


# Every kind Muster runs but Pods (a Pod is gated, not suspended, and a pod group is no single
# object to hold): what the front door lists.
WATCHED: tuple[Adapter, ...] = tuple(
    a for a in ADAPTERS if a.resource == a.created and a.resource != POD and a.front_door
)


def job_id_for(uid: str, spec_hash: str, first: bool) -> str:
    """`kube-<uid>` for the spec first applied; `kube-<uid>-<hash>` for an edited spec (a
    resubmission). Stable, so a re-apply or a restart finds the same job."""
    return f"kube-{uid}" if first else f"kube-{uid}-{spec_hash[:8]}"


def spec_hash(obj: Mapping[str, Any], suspend: tuple[str, ...] | None, queue: str) -> str:
    """The spec without the suspend flag (resuming is not an edit), and the queue: what the
    job that runs is made of."""
    spec = copy.deepcopy(dict(obj.get("spec") or {}))
    if suspend is not None:
        _set(spec, suspend[1:], None)
    text = json.dumps([spec, queue], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _get(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(key)
    return cur


def _set(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set (or with None, drop) a nested key, creating the mappings on the way."""
    cur = obj
    for key in path[:-1]:
        nxt = cur.get(key)
        if not isinstance(nxt, dict):
            if value is None:
                return
            nxt = cur[key] = {}
        cur = nxt
    if value is None:
        cur.pop(path[-1], None)
    else:
        cur[path[-1]] = value


def queue_of(labels: Mapping[str, Any]) -> str | None:
    for key in QUEUE_LABELS:
        value = labels.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def submitted_manifest(
    obj: Mapping[str, Any], suspend: tuple[str, ...], job_id: str
) -> dict[str, Any]:
    """What the broker gets on the submit subject (it derives the JobSpec, as for `muster
    submit`): the user's object as applied, unsuspended (the copy must run), named by the job
    id annotation, without server fields, the front door's own annotations and finalizer, or
    the queue labels (a Kueue beside the copy must leave it alone; the subject names the
    queue)."""
    meta = dict(obj.get("metadata") or {})
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in QUEUE_LABELS}
    annotations = {
        k: v
        for k, v in (meta.get("annotations") or {}).items()
        if not k.startswith(ANN_PREFIX) and k != "kubectl.kubernetes.io/last-applied-configuration"
    }
    annotations[ANN_JOB_ID] = job_id
    out: dict[str, Any] = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            **({"labels": labels} if labels else {}),
            **({"annotations": annotations} if annotations else {}),
        },
        "spec": copy.deepcopy(obj.get("spec") or {}),
    }
    _set(out, suspend, None)
    return out


class Verdict(NamedTuple):
    """What the home object shows: the condition's status, reason and message."""

    status: str  # True | False
    reason: str
    message: str
    cluster: str = ""


def verdict_of(
    state: str, cluster: str | None, flavor: str | None, attempt: int, resume: int | None, why: str
) -> Verdict:
    """The condition for a job state, saying where it runs and from which step."""
    where = f"cluster {cluster}" + (f" (flavor {flavor})" if flavor else "")
    if state in ("admitted", "running"):
        text = f"{'running' if state == 'running' else 'admitted'} on {where}, attempt {attempt}"
        if resume is not None:
            text += f", resuming from step {resume}"
        return Verdict("True", state.capitalize(), text, cluster or "")
    if state == "preempting":
        return Verdict("True", "Preempting", f"moving off {where}: {why or 'preempted'}", "")
    if state == "queued":
        return Verdict("False", "Queued", why or "waiting for capacity")
    text = {"succeeded": "the job succeeded", "cancelled": "the job was cancelled"}.get(state, "")
    return Verdict("False", state.capitalize(), why or text or f"the job {state}", cluster or "")


@dataclass
class Tracked:
    """A home object whose job the agent follows."""

    path: str  # the object's item path
    job_id: str
    team: str | None
    resume: int | None = None
    shown: Verdict | None = None
    stale: bool = True  # what the object shows may be behind the broker: ask it again
    sub: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class FrontDoor:
    """One cluster's front door (see module docstring). `start` after the backend's REST
    client exists; `stop` unsubscribes and ends the poll loop."""

    def __init__(
        self,
        cluster: str,
        rest: Callable[[], KubeRest],
        config: FrontDoorConfig,
        subjects: Subjects,
    ) -> None:
        self.cluster = cluster
        self._rest = rest  # the backend's, which exists once the backend started
        self.config = config
        self.subjects = subjects
        self.nc: Client | None = None
        self.tracked: dict[str, Tracked] = {}  # by uid
        self.absent: set[str] = set()  # collections whose CRD is not installed
        self.submits = 0  # submissions sent (a re-apply or restart must not add one)
        self.log = log.bind(cluster=cluster)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._passes = 0

    @property
    def rest(self) -> KubeRest:
        return self._rest()

    async def start(self, nc: Client) -> None:
        self.nc = nc
        self._stop.clear()
        self._task = asyncio.create_task(self._run(), name=f"frontdoor-{self.cluster}")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        for t in self.tracked.values():
            if t.sub is not None:
                with contextlib.suppress(Exception):
                    await t.sub.unsubscribe()
        self.tracked.clear()

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.sync()
            except Exception:
                self.log.exception("frontdoor.sync_failed")
            if await sleep_or_stop(self._stop, self.config.poll_s):
                return

    # -- one pass ------------------------------------------------------------------------
    async def sync(self) -> None:
        """Every marked object of every configured namespace, once."""
        self._passes += 1
        if self._passes % ABSENT_RECHECK_PASSES == 0:
            self.absent.clear()  # a CRD installed since is found
        seen: set[str] = set()
        complete = True
        for ns, access in self.config.namespaces.items():
            for adapter in WATCHED:
                collection = adapter.resource.collection(ns)
                if collection in self.absent:
                    continue
                try:
                    objects = await self._marked(collection)
                except KubeApiError as exc:
                    complete = False
                    hint = (
                        f"; grant the Role muster-agent-frontdoor in namespace {ns} "
                        f"(deploy/agent/rbac.yaml)"
                        if exc.status == 403
                        else ""
                    )
                    self.log.warning("frontdoor.list_failed", error=f"{exc}{hint}")
                    continue
                seen |= {str(o["metadata"]["uid"]) for o in objects}
                for obj in objects:
                    try:
                        await self.reconcile(adapter.resource, collection, obj, access)
                    except KubeApiError as exc:
                        # A 409 is a write that raced another (the operator, an event being
                        # mirrored): the next pass reads afresh.
                        name = obj.get("metadata", {}).get("name")
                        self.log.warning("frontdoor.write_failed", object=name, error=str(exc))
                    except Exception:
                        name = obj.get("metadata", {}).get("name")
                        self.log.exception("frontdoor.reconcile_failed", object=name)
        if complete:  # objects gone without the finalizer's help (removed by hand)
            for uid in set(self.tracked) - seen:
                await self._forget(uid)

    async def _marked(self, collection: str) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for label in QUEUE_LABELS:
            query = [("labelSelector", f"{label},!{LABEL_TOP}")]
            try:
                data = await self.rest.request("GET", collection, query=query)
            except KubeApiError as exc:
                if exc.status == 404:  # the kind's CRD is not installed here
                    self.absent.add(collection)
                    return []
                raise
            for obj in json.loads(data or b"{}").get("items") or []:
                seen[obj["metadata"]["uid"]] = obj
        return list(seen.values())

    async def reconcile(
        self,
        resource: Resource,
        collection: str,
        obj: dict[str, Any],
        access: FrontDoorNamespace,
    ) -> None:
        meta = obj["metadata"]
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        if LABEL_JOB in labels:  # a copy Muster made
            return
        path = item_path(collection, meta["name"])
        uid = str(meta["uid"])
        job_id = annotations.get(ANN_JOB)
        if meta.get("deletionTimestamp"):
            await self._deleted(obj, path, uid, job_id, access)
            return
        suspend = suspend_of(resource)
        queue = queue_of(labels) or ""
        if suspend.path is None:
            await self.refuse(
                obj,
                path,
                "UnsupportedKind",
                f"{resource.kind} has no suspend field, so it would start before Muster places "
                f"it; submit it with `muster submit` instead, or use a kind that can be "
                f"suspended",
            )
            return
        if queue not in access.queues:
            allowed = ", ".join(access.queues)
            await self.refuse(
                obj,
                path,
                "QueueNotAllowed",
                f"namespace {meta['namespace']} may not use queue {queue!r}; it may use: "
                f"{allowed}. Set the queue label to one of them, or ask the platform team to "
                f"add the queue to the agent's frontdoor.namespaces.{meta['namespace']}.queues",
            )
            return
        digest = spec_hash(obj, suspend.path, queue)
        if job_id and annotations.get(ANN_SPEC) == digest:
            if annotations.get(ANN_STATE) in ENDED:
                return  # its job ended; the broker may have compacted it since: never rerun
            if not await self._follow(obj, uid, path, job_id, access.team):
                # Marked as submitted, but the broker never stored it (a restart between the
                # annotation and the publish): submit it now, with the same id.
                await self._submit(obj, path, uid, queue, digest, suspend.path, access, job_id)
            return
        if _get(obj, suspend.path) is not True and not job_id:
            await self.refuse(
                obj,
                path,
                "NotSuspended",
                f"the object is not suspended, so its own controller runs it already; set "
                f"{'.'.join(suspend.path)}: true to let Muster place it",
            )
            return
        if annotations.get(ANN_STATE) in REFUSALS and annotations.get(ANN_SPEC) == digest:
            return  # refused before, and nothing changed since
        if job_id:  # the spec was edited: run the new one instead, as Kueue recreates
            reason = "the spec was edited; running the new one"
            if not await self._cancel(job_id, access.team, reason):
                return  # never two jobs for one object: the next pass tries again
            await self._forget(uid)
        new_id = job_id_for(uid, digest, first=not job_id)
        await self._submit(obj, path, uid, queue, digest, suspend.path, access, new_id)

    # -- submission ----------------------------------------------------------------------
    async def _submit(
        self,
        obj: dict[str, Any],
        path: str,
        uid: str,
        queue: str,
        digest: str,
        suspend: tuple[str, ...],
        access: FrontDoorNamespace,
        job_id: str,
    ) -> None:
        manifest = submitted_manifest(obj, suspend, job_id)
        # The job id and the finalizer are on the object before the broker hears of it: a
        # restart in between finds the id and asks the broker, never making a second job.
        finalizers = [f for f in obj["metadata"].get("finalizers") or [] if f != FINALIZER]
        await self._patch(
            path,
            {
                "metadata": {
                    "finalizers": [*finalizers, FINALIZER],
                    "annotations": {ANN_JOB: job_id, ANN_SPEC: digest},
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                }
            },
        )
        reply = await self._send_submit(queue, job_id, manifest)
        if reply is None:
            return  # no answer: the next pass asks the broker about this id
        if not reply.accepted:
            error = reply.error or "the broker refused the job without a reason"
            reason = "InvalidJob" if "invalid manifest" in error else "Rejected"
            await self.refuse(obj, path, reason, error, {ANN_SPEC: digest, ANN_JOB: None})
            await self._drop_finalizer(path)
            return
        self.log.info("frontdoor.submitted", job_id=job_id, queue=queue, object=path)
        await self.event(obj, "Normal", "Submitted", f"submitted to queue {queue} as {job_id}")
        await self._follow(obj, uid, path, job_id, access.team)

    async def _send_submit(
        self, queue: str, job_id: str, manifest: dict[str, Any]
    ) -> SubmitReply | None:
        assert self.nc is not None
        self.submits += 1
        try:
            msg = await submit_request(
                self.nc,
                self.subjects.submit(queue),
                encode_json(manifest),
                self.config.request_timeout_s,
            )
            return decode_submit_reply(msg.data)
        except (NatsTimeoutError, NoRespondersError, DecodeError) as exc:
            self.log.warning("frontdoor.submit_unanswered", job_id=job_id, error=str(exc))
            return None

    # -- following a job -----------------------------------------------------------------
    async def _follow(
        self, obj: dict[str, Any], uid: str, path: str, job_id: str, team: str | None
    ) -> bool:
        """Subscribe to the job's events once, and show where it stands now (again on a
        later pass while what is shown may be stale). False when the broker does not know
        the job."""
        tracked = self.tracked.get(uid)
        if tracked is None or tracked.job_id != job_id:
            tracked = self.tracked[uid] = Tracked(path, job_id, team)
            assert self.nc is not None
            subject = (
                self.subjects.team_events(team, job_id)
                if team
                else self.subjects.job_events(job_id)
            )
            tracked.sub = await self.nc.subscribe(subject, cb=self._listener(uid, tracked))
        elif not tracked.stale:
            return True
        view = await self._api(team, "get", JobRef(job_id=job_id))
        if isinstance(view, str) and view.startswith("unknown job"):
            await self._forget(uid)
            return False
        if isinstance(view, JobView):
            resume = next(
                (a.resume_from_step for a in reversed(view.attempts) if a.attempt == view.attempt),
                None,
            )
            tracked.resume = resume
            why = view.waiting or view.reason or ""
            verdict = verdict_of(view.state, view.cluster, view.flavor, view.attempt, resume, why)
            await self.show(obj, tracked, verdict)
            tracked.stale = False
        return True

    def _listener(self, uid: str, tracked: Tracked) -> Callable[[Any], Awaitable[None]]:
        async def on_event(msg: Any) -> None:
            try:
                await self._on_event(uid, decode_job_event(msg.data))
            except DecodeError:
                pass
            except Exception as exc:  # the write failed: the next pass asks the broker
                tracked.stale = True
                self.log.warning("frontdoor.mirror_failed", job_id=tracked.job_id, error=str(exc))

        return on_event

    async def _on_event(self, uid: str, ev: JobEvent) -> None:
        tracked = self.tracked.get(uid)
        if tracked is None or ev.job_id != tracked.job_id:
            return
        if ev.kind == "admitted":
            tracked.resume = ev.resume_from_step
        why = ev.reason or ""
        if ev.state == "queued" and ev.kind in ("queued", "requeued"):
            view = await self._api(tracked.team, "get", JobRef(job_id=tracked.job_id))
            if isinstance(view, JobView) and view.waiting:
                why = view.waiting
        verdict = verdict_of(ev.state, ev.cluster, ev.flavor, ev.attempt, tracked.resume, why)
        obj = await self._read(tracked.path)
        if obj is not None:
            await self.show(obj, tracked, verdict)

    # -- deletion ------------------------------------------------------------------------
    async def _deleted(
        self,
        obj: dict[str, Any],
        path: str,
        uid: str,
        job_id: str | None,
        access: FrontDoorNamespace,
    ) -> None:
        """`kubectl delete`: cancel the job everywhere, then let the object go."""
        if FINALIZER not in (obj["metadata"].get("finalizers") or []):
            return
        if job_id:
            if not await self._cancel(job_id, access.team, "the home object was deleted"):
                return  # the broker did not answer: the finalizer holds, the next pass retries
            await self.event(obj, "Normal", "Cancelled", f"job {job_id} cancelled")
        await self._forget(uid)
        await self._drop_finalizer(path)

    async def _cancel(self, job_id: str, team: str | None, reason: str) -> bool:
        """True once the broker has the job cancelled (or ended, or never had it)."""
        out = await self._api(team, "cancel", CancelRequest(job_id=job_id, reason=reason))
        if isinstance(out, str):  # never had it, or it ended before
            return "unknown job" in out or "already" in out
        return out is not None

    async def _forget(self, uid: str) -> None:
        tracked = self.tracked.pop(uid, None)
        if tracked is not None and tracked.sub is not None:
            with contextlib.suppress(Exception):
                await tracked.sub.unsubscribe()

    async def _drop_finalizer(self, path: str) -> None:
        obj = await self._read(path)
        if obj is None:
            return
        left = [f for f in obj["metadata"].get("finalizers") or [] if f != FINALIZER]
        meta = {"finalizers": left or None, "resourceVersion": obj["metadata"]["resourceVersion"]}
        await self._patch(path, {"metadata": meta})

    # -- the broker's API ----------------------------------------------------------------
    async def _api(self, team: str | None, verb: str, body: msgspec.Struct) -> JobView | str | None:
        """The broker's answer: the job, the refusal text, or None when nobody answered."""
        assert self.nc is not None
        subject = self.subjects.api_as(team, verb) if team else self.subjects.api(verb)
        try:
            msg = await self.nc.request(
                subject, encode_json(body), timeout=self.config.request_timeout_s
            )
            reply = _decode_view(msg.data)
        except (NatsTimeoutError, NoRespondersError, DecodeError) as exc:
            self.log.warning("frontdoor.api_unanswered", verb=verb, error=str(exc))
            return None
        if reply.ok and reply.result is not None:
            return reply.result
        return reply.error or f"{verb} failed"

    # -- writing to the home object ------------------------------------------------------
    async def refuse(
        self,
        obj: dict[str, Any],
        path: str,
        reason: str,
        message: str,
        extra: dict[str, str | None] | None = None,
    ) -> None:
        """Bad input: a condition and an event saying why, and nothing else."""
        annotations = obj["metadata"].get("annotations") or {}
        if annotations.get(ANN_STATE) == reason and annotations.get(ANN_MESSAGE) == message:
            return
        await self.show(obj, None, Verdict("False", reason, message), extra)

    async def show(
        self,
        obj: dict[str, Any],
        tracked: Tracked | None,
        verdict: Verdict,
        extra: dict[str, str | None] | None = None,
    ) -> None:
        """Annotations (every kind), the condition (kinds whose status takes one) and an
        Event, when what the object shows changes."""
        lock = tracked.lock if tracked is not None else asyncio.Lock()
        async with lock:
            if tracked is not None and tracked.shown == verdict:
                return
            annotations = obj["metadata"].get("annotations") or {}
            same = (
                annotations.get(ANN_STATE) == verdict.reason
                and annotations.get(ANN_MESSAGE) == verdict.message
            )
            path = item_path(_collection_of(obj), obj["metadata"]["name"])
            if not same or extra:
                patch = {
                    ANN_STATE: verdict.reason,
                    ANN_MESSAGE: verdict.message,
                    ANN_CLUSTER: verdict.cluster or None,
                    **(extra or {}),
                }
                await self._patch(path, {"metadata": {"annotations": patch}})
                if suspend_of(_resource_of(obj)).conditions:
                    await self.write_condition(path, verdict)
                kind = "Warning" if verdict.reason in WARNINGS else "Normal"
                await self.event(obj, kind, verdict.reason, verdict.message)
            if tracked is not None:
                tracked.shown = verdict

    async def write_condition(self, path: str, verdict: Verdict) -> None:
        """The MusterAdmitted condition in the status subresource, every other condition
        kept; the resourceVersion makes a concurrent status write (the operator's) a 409,
        retried on a fresh read. Only the fields metav1.Condition (JobSet, TrainJob) and the
        Kubeflow JobCondition share; the transition time moves only when the status does."""
        for _ in range(3):
            obj = await self._read(path)
            if obj is None:
                return
            existing = (obj.get("status") or {}).get("conditions") or []
            conditions = [c for c in existing if c.get("type") != CONDITION]
            before: dict[str, Any] = next((c for c in existing if c.get("type") == CONDITION), {})
            since = (
                before.get("lastTransitionTime") if before.get("status") == verdict.status else None
            )
            conditions.append(
                {
                    "type": CONDITION,
                    "status": verdict.status,
                    "reason": verdict.reason,
                    "message": verdict.message[:1024],
                    "lastTransitionTime": since or _rfc3339(time.time()),
                }
            )
            body = {
                "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                "status": {"conditions": conditions},
            }
            try:
                await self.rest.request(
                    "PATCH", f"{path}/status", body=body, content_type=MERGE_PATCH
                )
                return
            except KubeApiError as exc:
                if exc.status != 409:
                    raise

    async def event(self, obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
        """A core/v1 Event on the object, as `kubectl describe` lists them."""
        meta = obj["metadata"]
        now = _rfc3339(time.time())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": obj["apiVersion"],
                "kind": obj["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": COMPONENT},
            "reportingComponent": f"{DOMAIN}/frontdoor",
            "reportingInstance": self.cluster,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.rest.request(
                "POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=body
            )
        except KubeApiError as exc:  # an event is a courtesy: never worth failing for
            self.log.warning("frontdoor.event_failed", error=str(exc))

    async def _read(self, path: str) -> dict[str, Any] | None:
        data = await self.rest.request("GET", path, ok_missing=True)
        if data is None:
            return None
        out = json.loads(data)
        return out if isinstance(out, dict) else None

    async def _patch(self, path: str, body: dict[str, Any]) -> None:
        await self.rest.request("PATCH", path, body=body, content_type=MERGE_PATCH)


# Reasons that mean nothing runs for the object as it is.
REFUSALS = frozenset(
    {"UnsupportedKind", "QueueNotAllowed", "NotSuspended", "InvalidJob", "Rejected"}
)
WARNINGS = REFUSALS | {"Failed", "Preempting"}
ENDED = frozenset({"Succeeded", "Failed", "Cancelled"})
ABSENT_RECHECK_PASSES = 150  # a missing CRD is looked for again every 150 passes (5 min at 2 s)


def _resource_of(obj: Mapping[str, Any]) -> Resource:
    for a in WATCHED:
        if a.handles(str(obj.get("apiVersion", "")), str(obj.get("kind", ""))):
            return a.resource
    raise ValueError(f"not a watched kind: {obj.get('apiVersion')} {obj.get('kind')}")


def _collection_of(obj: Mapping[str, Any]) -> str:
    return _resource_of(obj).collection(str(obj["metadata"]["namespace"]))


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
