"""Muster's objects in the cluster: created for a dispatch, found by a scan, deleted for a
cancel, an older attempt or as garbage, and the pods patched or deleted for an attempt.

Everything here writes to the API server; what the objects and pods say about an attempt is
`attempts.py`'s, and when to write is the backend's.

Attempts and cleanup: `create` makes the objects of `manifests.build_workload` (a 409 counts
as created when the object is the attempt's own, so a retried dispatch is safe); the backend
then deletes every object of an older attempt of the same job in the background, and the
periodic resync (`collect_garbage`) does the same for anything left over. A cancel deletes with
the configured propagation policy (Background by default; Jobs would otherwise orphan their
pods). Both list the cluster for the job's objects only when what is known here may not be
all of them (`known_in_full`).

Checkpoint requests (for the SDK): `checkpoint_now` merge-patches every pod of the attempt
with the annotation `muster.dev/checkpoint-request: "<deadline as unix seconds>"`. Workloads
see it in the file `$MUSTER_PODINFO_DIR/annotations` (a downward-API volume every Muster pod
gets; the kubelet refreshes it within its sync period, typically under a minute) or by reading
their own pod. Requests never travel on NATS, where every workload (one shared NATS user)
could hear them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import msgspec

from agents.backend import BackendError, CannotResize, JobRefused
from agents.kube.attempts import Attempts, Key, owned_key
from agents.kube.client import KubeApiError, KubeRest, item_path
from agents.kube.config import KubeBackendConfig
from agents.kube.decode import KMeta, KObject, KPod
from agents.kube.fencing import fence_marked
from agents.kube.quota import quota_message
from agents.kube.status import Workload
from kinds.base import (
    ANN_CHECKPOINT_REQUEST,
    ANN_JOB,
    LABEL_PODSET,
    POD,
    ResizeRefused,
    Resource,
)
from kinds.base import KindError as ManifestError
from kinds.plan import PlannedObject, WorkloadPlan, owner_reference
from kinds.pods import selector
from kinds.registry import OWNED_RESOURCES, adapter_of
from schemas.agent import Dispatch


class WorkloadObjects:
    """Creates, finds and deletes the objects of the attempts in `attempts`."""

    def __init__(
        self,
        config: KubeBackendConfig,
        namespaces: list[str],
        attempts: Attempts,
        rest: Callable[[], KubeRest],
        pods: Callable[[], Mapping[str, KPod]],
        log: Any,
    ) -> None:
        self.config = config
        self._namespaces = namespaces
        self.attempts = attempts
        self._rest = rest
        self._pods = pods  # Muster's pods as last seen, by uid
        self.log = log
        # A full scan has run: every object older than it was found then, and every one
        # since was made here, so what `attempts` knows is all there is (one agent per
        # cluster: deploy/agent/deployment.yaml's Recreate strategy).
        self.scanned = False
        self.deletions: Counter[str] = Counter()  # attempts' deletions: "listed" or "known"

    @property
    def rest(self) -> KubeRest:
        return self._rest()

    def _namespace_of(self, key: Key) -> str:
        return self.attempts.namespace_of(key, self.config.namespace)

    async def create(self, cmd: Dispatch, ns: str, plan: WorkloadPlan, w: Workload) -> None:
        """Create the plan's objects in order (an owner before what it owns); a 409 counts as
        created when the object is this attempt's own. A quota refusal is JobRefused. No phase
        of the attempt is reported meanwhile (`Workload.creating`)."""
        w.complete = False  # until every object is made: one that fails may exist all the same
        w.creating = True
        try:
            await self._create_each(cmd, ns, plan, w)
        finally:
            w.creating = False

    async def _create_each(self, cmd: Dispatch, ns: str, plan: WorkloadPlan, w: Workload) -> None:
        key = (cmd.job_id, cmd.attempt)
        bound = self.log.bind(job_id=cmd.job_id, attempt=cmd.attempt, flavor=cmd.flavor)
        uids: dict[str, str] = {}
        for obj in plan.objects:
            collection = obj.resource.collection(ns)
            marked = fence_marked(cmd, obj)
            try:
                body = self._owned(marked, plan.objects, uids)
                created = await self.rest.create(collection, body)
                uid = (created or {}).get("metadata", {}).get("uid")
                if created is None:
                    # It exists: a retried dispatch, or a name that is not ours to take.
                    uid = await self._adoptable(collection, obj, body, key)
                uids[obj.name] = str(uid or "")
                if (collection, obj.name) not in w.objects:
                    w.objects.append((collection, obj.name))
                if collection in self.attempts.status_kinds:
                    w.expect_object((collection, obj.name))
            except KubeApiError as exc:
                if exc.status == 403 and "exceeded quota" in str(exc):
                    why = quota_message(ns, str(exc))
                    raise JobRefused(f"creating {obj.resource.kind} {obj.name}: {why}") from None
                raise BackendError(f"creating {obj.resource.kind} {obj.name}: {exc}") from None
            except (TimeoutError, OSError, aiohttp.ClientError) as exc:
                raise BackendError(f"creating {obj.resource.kind} {obj.name}: {exc!r}") from None
            bound.info("created", kind=obj.resource.kind, name=obj.name, existed=created is None)
        w.complete = True

    async def resize(self, cmd: Dispatch, ns: str, plan: WorkloadPlan) -> None:
        """Patch the attempt's main object, or the object that runs its pods (a RayJob's
        RayCluster: `Adapter.resize_target`), to what the revision renders
        (`Adapter.resize_body`: the kind's own replica field). CannotResize when the kind
        cannot change size in place, or the API server refuses the patch (403: the agent's
        Role lacks patch on that kind; 422: the object does not take it)."""
        main = plan.objects[0]
        collection = main.resource.collection(ns)
        what = f"{main.resource.kind} {main.name}"
        adapter = adapter_of(main.body)
        try:
            live = await self.rest.object_of(collection, main.name)
            if live is None:
                raise BackendError(f"{what} is gone; attempt {cmd.attempt} cannot be resized")
            target = adapter.resize_target(live)
            patch = adapter.resize_body(live, main.body, self._leaving(cmd, ns))
            path = f"{collection}/{main.name}"
            if target is not None and adapter.resized is not None:
                path = adapter.resized.item(ns, target)
                what = f"{what} ({adapter.resized.kind} {target})"
            if not await self.rest.merge_patch(path, patch):
                raise BackendError(f"{what} is gone; attempt {cmd.attempt} cannot be resized")
        except ResizeRefused as exc:
            raise CannotResize(f"{what}: {exc}") from None
        except ManifestError as exc:
            raise BackendError(f"{what}: {exc}") from None
        except KubeApiError as exc:
            if exc.status == 403:
                kind = adapter.resized or main.resource
                raise CannotResize(
                    f"{what}: the agent may not patch {kind.plural}.{kind.group} in namespace "
                    f"{ns} ({exc}); grant it patch there, as deploy/agent/rbac.yaml of this "
                    "release does"
                ) from None
            if exc.status == 422:
                raise CannotResize(f"{what}: the API server refused the resize: {exc}") from None
            raise BackendError(f"resizing {what}: {exc}") from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise BackendError(f"resizing {what}: {exc!r}") from None
        self.log.info("resized", job_id=cmd.job_id, attempt=cmd.attempt, kind=main.resource.kind)

    def _leaving(self, cmd: Dispatch, ns: str) -> dict[str, list[str]]:
        """The attempt's pods, by podset, on nodes the revision no longer assigns that podset
        (a shrink): the ones a kind that picks which pods to delete should delete."""
        keep = {a.podset: set(a.nodes) for a in cmd.assignment}
        cache = self._pods()
        out: dict[str, list[str]] = {}
        for uid, name in self.attempts.pod_names.get((cmd.job_id, cmd.attempt), {}).items():
            pod = cache.get(uid)
            if pod is None or pod.metadata.namespace not in ("", ns):
                continue
            podset = pod.metadata.labels.get(LABEL_PODSET, "")
            node = pod.spec.nodeName
            if podset in keep and node and node not in keep[podset]:
                out.setdefault(podset, []).append(name)
        return out

    async def scan(
        self, resources: list[Resource] | tuple[Resource, ...] = OWNED_RESOURCES
    ) -> list[tuple[Key, str, str]]:
        """List every Muster-owned object of the given kinds in the workload namespaces
        (a kind whose CRD is not installed answers 404 and is skipped)."""
        found: list[tuple[Key, str, str]] = []
        for collection in (r.collection(ns) for ns in self._namespaces for r in resources):
            try:
                items, _ = await self.rest.list_all(
                    collection, KObject, selector(), self.config.list_page_size
                )
            except KubeApiError as exc:
                if exc.status in (404, 403):
                    continue
                raise
            for obj in items:
                meta = obj.metadata
                key = owned_key(meta)
                if key is None:
                    continue
                found.append((key, collection, meta.name))
                self.attempts.found_object(key, collection, meta)
        return found

    async def delete(self, objects: list[tuple[str, str]]) -> None:
        """All at once within the API budget (a Pod-kind gang is one object per pod); the
        first failure is raised once every delete has been tried."""
        results = await asyncio.gather(
            *(
                self.rest.delete(item_path(c, n), self.config.delete_propagation)
                for c, n in objects
            ),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def delete_attempts(
        self, job_id: str, keep: Callable[[int], bool], why: str, only: int | None = None
    ) -> int:
        """Delete every object of `job_id` whose attempt is not kept; the count deleted.
        Uses what is known locally plus, until `known_in_full` says otherwise, a fresh list
        by label (an object created by a previous agent instance may not be known yet), one
        per workload kind. `only`: the one attempt not kept, when there is one. The lists go
        to the job's namespace when one of its attempts is known here, else to every
        workload namespace."""
        targets: dict[tuple[str, str], None] = {}  # ordered, O(1) membership
        known: dict[str, None] = {}
        targeted: list[Workload] = []
        for (jid, attempt), w in self.attempts.workloads.items():
            if jid == job_id and w.namespace:
                known[w.namespace] = None
            if jid == job_id and not keep(attempt):
                w.cancelled = True
                targets.update(dict.fromkeys(w.objects))
                targeted.append(w)
        if self.known_in_full(targeted, only):
            await self.delete(list(targets))
            self._deleted(job_id, len(targets), why, listed=False)
            return len(targets)
        spaces = list(known) or self._namespaces
        for collection in (r.collection(ns) for ns in spaces for r in OWNED_RESOURCES):
            try:
                items, _ = await self.rest.list_all(collection, KObject, selector(job_id))
            except KubeApiError as exc:
                if exc.status in (404, 403):
                    continue
                raise
            for obj in items:
                # The label may be a shortened form that another id shares: only the exact
                # id in the annotation makes an object this job's to delete.
                found = owned_key(obj.metadata)
                if obj.metadata.annotations.get(ANN_JOB) != job_id or found is None:
                    continue
                if keep(found[1]):
                    continue
                targets[(collection, obj.metadata.name)] = None
        await self.delete(list(targets))
        self._deleted(job_id, len(targets), why, listed=True)
        return len(targets)

    def known_in_full(self, targeted: list[Workload], only: int | None) -> bool:
        """Whether the objects known here of the attempts being deleted (`targeted`; `only`:
        the one attempt asked for, if one) are all their objects, so no list is needed. Each
        targeted attempt must have been made here in full (a create that failed may have
        made its object all the same, and one found by a scan or a watch may have more), and
        no attempt unknown here may exist: after a full scan by this instance, none does
        (every object older than it was found then, and every one since was made here), and
        before it, only the one attempt asked for, when it is known, is certain (its objects'
        names come from the attempt, so an earlier instance could only have made the same
        ones). A list is one request per workload kind (fifteen) within the agent's API
        budget, which a burst of Cancels or re-dispatches would spend finding nothing."""
        if not all(w.complete for w in targeted):
            return False
        return self.scanned or (only is not None and any(w.attempt == only for w in targeted))

    def _deleted(self, job_id: str, count: int, why: str, *, listed: bool) -> None:
        self.deletions["listed" if listed else "known"] += 1
        if count:
            self.log.info(
                "deleted workload objects", job_id=job_id, count=count, why=why, listed=listed
            )

    async def _adoptable(
        self, collection: str, obj: PlannedObject, body: dict[str, Any], key: Key
    ) -> str:
        """The uid of an object that already exists under a planned name, when it is this
        attempt's own (a retried dispatch): the same job id and attempt in its annotation and
        labels and, for a controlled object, the same owner. Anything else is refused, never
        adopted (and so never deleted with this attempt): another job's object under a
        colliding name, or one from an earlier agent of another attempt."""
        meta = await self.rest.metadata_of(collection, obj.name)
        if meta is None:
            raise BackendError(
                f"{obj.resource.kind} {obj.name} was reported to exist but is gone; "
                "the dispatch is retried"
            )
        found = owned_key(msgspec.convert(meta, KMeta, strict=False))
        owners = {str(r.get("uid", "")) for r in meta.get("ownerReferences") or []}
        wanted = {str(r.get("uid")) for r in body["metadata"].get("ownerReferences") or []}
        if found != key or not wanted <= owners:
            self.log.error(
                "object name taken by another job; refusing to adopt it",
                kind=obj.resource.kind,
                name=obj.name,
                job_id=key[0],
                attempt=key[1],
                holder=f"{found[0]} attempt {found[1]}" if found else "not Muster's",
            )
            raise BackendError(
                f"{obj.resource.kind} {obj.name} already exists in namespace "
                f"{body['metadata'].get('namespace', '')} and is not this attempt's "
                f"({'another job' if found and found[0] != key[0] else 'another attempt or owner'}"
                "); refusing to adopt or delete it. Delete it if it is stale, or resubmit "
                "under another job id"
            )
        return str(meta.get("uid", ""))

    @staticmethod
    def _owned(
        obj: PlannedObject,
        objects: list[PlannedObject],
        uids: dict[str, str],
    ) -> dict[str, Any]:
        """The body with its controller reference, when the plan names an owner."""
        if not obj.owner:
            return obj.body
        owner = next(o for o in objects if o.name == obj.owner)
        uid = uids.get(obj.owner)
        if not uid:
            raise BackendError(f"{owner.resource.kind} {obj.owner} has no uid to own {obj.name}")
        body = dict(obj.body)
        body["metadata"] = {
            **obj.body["metadata"],
            "ownerReferences": [owner_reference(owner.resource, obj.owner, uid)],
        }
        return body

    async def gc_older(self, job_id: str, attempt: int) -> None:
        try:
            await self.delete_attempts(job_id, lambda a: a >= attempt, "older attempt")
        except (TimeoutError, KubeApiError, OSError, aiohttp.ClientError) as exc:
            self.log.warning(
                "garbage collection of older attempts failed", job_id=job_id, error=str(exc)
            )

    async def release_finished(self, key: Key) -> None:
        """An attempt finished: delete its pods that still run (or wait), so their GPUs are
        free at once instead of at ttlSecondsAfterFinished. Pods that finished stay, with
        the logs `muster logs` reads; the workload objects stay until their TTL or the next
        attempt's garbage collection."""
        cache = self._pods()
        base = POD.collection(self._namespace_of(key))
        running = [
            name
            for uid, name in self.attempts.pod_names.get(key, {}).items()
            if (pod := cache.get(uid)) is not None
            and pod.status.phase not in ("Succeeded", "Failed")
            and pod.metadata.deletionTimestamp is None
        ]
        if not running:
            return

        async def one(name: str) -> None:
            try:
                await self.rest.delete(item_path(base, name), self.config.delete_propagation)
            except (TimeoutError, KubeApiError, OSError, aiohttp.ClientError) as exc:
                self.log.warning("releasing a finished pod failed", pod=name, error=str(exc)[:200])

        await asyncio.gather(*(one(n) for n in running))
        self.log.info(
            "finished attempt: running pods deleted to free their GPUs",
            job_id=key[0],
            attempt=key[1],
            pods=len(running),
        )

    async def checkpoint_now(self, job_id: str, attempt: int, deadline: float) -> None:
        """One merge PATCH per pod, all at once within the API budget (`RateLimit`: requests
        in flight, qps and burst, 429s): the last rank of a 1,000-pod gang hears the request
        within a second or two, not after 1,000 sequential round trips."""
        names = list(self.attempts.pod_names.get((job_id, attempt), {}).values())
        if not names:
            # Nothing runs yet, so nothing can checkpoint; the broker's deadline still holds.
            self.log.warning("checkpoint request: no pods", job_id=job_id, attempt=attempt)
            return
        patch = {"metadata": {"annotations": {ANN_CHECKPOINT_REQUEST: f"{deadline:.3f}"}}}
        base = POD.collection(self._namespace_of((job_id, attempt)))

        async def one(name: str) -> str | None:
            try:
                await self.rest.merge_patch(item_path(base, name), patch)
            except (TimeoutError, KubeApiError, OSError, aiohttp.ClientError) as exc:
                return f"{name}: {exc}"
            return None

        failed = [f for f in await asyncio.gather(*(one(n) for n in names)) if f is not None]
        if failed and len(failed) == len(names):
            raise BackendError("checkpoint request failed: " + "; ".join(failed)[:900])
        if failed:
            self.log.warning(
                "checkpoint request missed some pods",
                job_id=job_id,
                attempt=attempt,
                failed=len(failed),
                first=failed[0][:300],
            )

    async def collect_garbage(self) -> int:
        found = await self.scan()
        self.scanned = True
        newest: dict[str, int] = {}
        for (job_id, attempt), _, _ in found:
            newest[job_id] = max(newest.get(job_id, 0), attempt)
        for job_id, attempt in self.attempts.workloads:
            newest[job_id] = max(newest.get(job_id, 0), attempt)
        stale = [(c, n) for (jid, a), c, n in found if a < newest[jid]]
        await self.delete(stale)
        live_objects = {key for key, _, _ in found}
        for key in list(self.attempts.workloads):
            w = self.attempts.workloads[key]
            if (
                (w.cancelled or w.terminal)
                and key not in live_objects
                and not self.attempts.pod_names.get(key)
            ):
                del self.attempts.workloads[key]
                self.attempts.pod_names.pop(key, None)
        return len(stale)
