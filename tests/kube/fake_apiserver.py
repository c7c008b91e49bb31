"""A FAKE Kubernetes API server: a test stand-in, NOT a real API server.

No real API server can be installed in this workplace (and kmock's watch does not work with
kubernetes-asyncio), so the kube backend is tested against this small aiohttp app. The client
under test is the real kubernetes-asyncio `ApiClient`, pointed at http://127.0.0.1:<port>.
A stand-in is only as good as its strictness, so wherever the agent depends on it, it refuses
and fails as a real API server does (docs/kubernetes.md lists what it does not model):

* storage per resource path: `/api/v1/...` and `/apis/<group>/<version>/...`, cluster-scoped
  (`nodes`) and namespaced (`pods`, `services`, `jobs`, CRDs), plus all-namespace lists;
* GET list with `labelSelector` (=, ==, !=, exists, !exists), `fieldSelector` (=, ==, != on
  the fields the real server supports for the kind; any other field is a 400), and the list's
  `metadata.resourceVersion`. `limit` + `continue` pagination is a consistent read: every page
  of one list comes from the snapshot of its first page (as etcd serves it at the list's
  revision), the token is the real shape (base64 of `{"v":"meta.k8s.io/v1","rv":..,"start":..}`)
  and a token older than `compact()` is the real 410 `Expired` Status; `resourceVersion=0` is
  served from the "watch cache": one body of everything, the `limit` ignored, as the real
  server does;
* GET `?watch=true` streaming one JSON event per line: replay from `resourceVersion`, then
  live events. Selectors are applied to the old and the new object, as the watch cache does:
  an object that starts matching arrives as ADDED, one that stops matching as DELETED with its
  previous content. `allowWatchBookmarks` -> BOOKMARK events (on demand with `bookmark()`, or
  every `bookmark_interval` seconds); `timeoutSeconds`; a too-old resourceVersion (older than
  `compact()`) gives 410 Gone, as an ERROR event or, with `gone_as_http=True`, an HTTP 410;
* POST (409 AlreadyExists, 422 Invalid), PATCH (JSON merge patch for merge- and, on built-in
  kinds, strategic-merge patch; a custom resource refuses a strategic merge patch with the real
  415 as the apiextensions server does; JSON patch (RFC 6902) whose failed operation is the
  real generic 422; 422 Invalid, immutable fields; a `metadata.resourceVersion` in the
  patch is a precondition, 409 Conflict; `.../<name>/status` writes the status only), DELETE
  with graceful deletion: a pod
  bound to a node gets `deletionTimestamp` + `deletionGracePeriodSeconds` and stays
  Terminating until its grace runs out (scaled by `termination_s`) or `finish_terminating()`;
  an object with `finalizers` stays until they are removed; `propagationPolicy` Background
  deletes the owner at once and its dependents gracefully, Foreground keeps the owner (with the
  `foregroundDeletion` finalizer) until its dependents are gone, Orphan leaves them;
* validation of what clients create or update (`tests.kube.validation`: the OpenAPI schema of
  a current release, strict, the vendored CRD schemas, the semantic rules and immutable
  fields), answered with the real 422 `Status` shape;
* the eviction subresource (`POST pods/<name>/eviction`, policy/v1): PodDisruptionBudgets
  honoured (429 TooManyRequests with a DisruptionBudget cause), the DisruptionTarget
  condition set, then a graceful delete (`_evict`);
* authentication: with `tokens` set, a request without one of them is a 401 (`revoke()`
  expires a token, as an exec-plugin or OIDC token expires);
* authorization, opt-in: with `authorizer` set (`tests.kube.rbac_authz.RbacAuthorizer`, the
  shipped RBAC of deploy/agent/), every request is decided for the user its token maps to in
  `users`, and refused with the real 403 Forbidden Status; a create that sets
  `blockOwnerDeletion` needs update on the owner's finalizers (OwnerReferencesPermission-
  Enforcement);
* ResourceQuota admission (tests/kube/quota_admission.py): a create in a namespace with a
  ResourceQuota that it would exceed is refused with the real 403 (`exceeded quota: ...`),
  an admitted one is charged to the quota's `status.used`;
* KubeRay's RayJob and RayCluster controllers, opt-in (`kuberay`, tests/kube/kuberay_model.py):
  a RayJob gets its RayCluster named in `status.rayClusterName`; `kuberay.reconcile(server)`
  scales each worker group's pods as KubeRay does;
* Kueue's job webhook, opt-in (`kueue_namespace_selector`, tests/kube/kueue_model.py): a job of
  a kind Kueue integrates, with a queue-name label or in a namespace its
  managedJobsNamespaceSelector matches, is created suspended;
* the Job controller's deadline, opt-in with `run_job_controller(clock)`: a batch/v1 Job
  created through the API gets `status.startTime`, and once `startTime +
  spec.activeDeadlineSeconds` has passed (on the given clock) the Job is marked Failed with
  reason DeadlineExceeded and its pods are deleted (gracefully), as the real controller does;
* API priority and fairness, opt-in: with `max_inflight` set, a request beyond that many in
  flight (non-watch) is answered with the real APF 429 (`TooManyRequests`, `Retry-After`);
  `latency_s` delays every non-watch answer (a real server is milliseconds away);
  `peak_inflight` records the most requests seen in flight at once;
* fault injection: `fail_next()` (an HTTP error for the next matching request, 429 with
  Retry-After), `reset_watches()` (connections dropped mid-watch), `expire_watches()` (ERROR
  410 on every open watch), `send_raw()` (garbage lines), `missing_groups` (a CRD that is not
  installed answers 404), `down = True` (an outage, e.g. a control-plane upgrade: every
  request is a 503 and open watches are dropped, until set back to False), `latency_s` (every
  request but a watch waits this long first, as through admission webhooks and etcd).

Objects tests put directly (`put`, what controllers and kubelets do) skip validation.
Everything binds to 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import base64
import calendar
import contextlib
import copy
import json
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.kube import kuberay_model, kueue_model, quota_admission
from tests.kube.rbac_authz import (
    Attributes,
    forbidden_status,
    owner_forbidden,
    request_attributes,
)
from tests.kube.validation import causes, invalid_status

Obj = dict[str, Any]
ResKey = tuple[str, str]  # (group/version, plural), e.g. ("v1", "pods")

CLUSTER_SCOPED = {"nodes", "namespaces", "nodepools", "nodeclaims"}
JOBS_RES: ResKey = ("batch/v1", "jobs")
QUOTAS_RES: ResKey = ("v1", "resourcequotas")
KINDS = {
    "nodes": "Node",
    "pods": "Pod",
    "services": "Service",
    "jobs": "Job",
    "namespaces": "Namespace",
    "pytorchjobs": "PyTorchJob",
    "tfjobs": "TFJob",
    "mpijobs": "MPIJob",
    "jobsets": "JobSet",
    "events": "Event",
    "nodepools": "NodePool",
    "nodeclaims": "NodeClaim",
    "provisioningrequests": "ProvisioningRequest",
    "podtemplates": "PodTemplate",
    "rayclusters": "RayCluster",
}
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
# API groups served by the API server itself (the rest are custom resources, which take JSON
# patch, merge patch and apply, never a strategic merge patch).
BUILT_IN = frozenset(
    {"v1", "batch/v1", "coordination.k8s.io/v1", "policy/v1", "apps/v1", "events.k8s.io/v1"}
)
# apiextensions-apiserver `customresource_handler.go` (the patch types a CRD serves) and
# apiserver `endpoints/handlers/negotiation` (the 415 text), kubernetes/kubernetes, Apache-2.0.
CRD_PATCH_TYPES = (JSON_PATCH, MERGE, "application/apply-patch+yaml")
BUILT_IN_PATCH_TYPES = (JSON_PATCH, MERGE, STRATEGIC, "application/apply-patch+yaml")
UNKNOWN_FORMAT = "the body of the request was in an unknown format - accepted media types include: "
# apimachinery `errors.NewGenericServerResponse` for 422: what a JSON patch whose operation
# fails (a `test`, a missing path) is answered with, the operation not named.
JSON_PATCH_FAILED = "the server rejected our request due to an error in our request"
# The field selectors the real API server accepts per resource (anything else: 400).
FIELD_LABELS: dict[str, set[str]] = {
    "pods": {
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    },
    "nodes": {"metadata.name", "spec.unschedulable"},
}
DEFAULT_FIELDS = {"metadata.name", "metadata.namespace"}
RESET = b"__reset__"
JSON = "application/json"
# The real message of a 410 on an expired continue token (k8s.io/apiserver storage errors).
EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can "
    "start a new list without the continue parameter, or use the continue token in this "
    "response to retrieve the remainder of the results. Continuing with the provided token "
    "results in an inconsistent list - objects that were created, modified, or deleted "
    "between the time the first chunk was returned and now may show up in the list."
)  # queue marker: drop the connection without ending the stream


def _pointer(path: str) -> list[str]:
    """RFC 6901: "/a/b~1c" -> ["a", "b/c"]."""
    if path and not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r} does not start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    parts = _pointer(path)
    if not parts:
        raise ValueError("the whole document cannot be patched")
    cur = doc
    for key in parts[:-1]:
        if isinstance(cur, list) and key.isdigit() and int(key) < len(cur):
            cur = cur[int(key)]
        elif isinstance(cur, dict) and key in cur:
            cur = cur[key]
        else:
            raise ValueError(f"path {path!r} does not exist")
    return cur, parts[-1]


def _get(doc: Any, path: str) -> Any:
    parent, key = _parent(doc, path)
    if isinstance(parent, list) and key.isdigit() and int(key) < len(parent):
        return parent[int(key)]
    if isinstance(parent, dict) and key in parent:
        return parent[key]
    raise ValueError(f"path {path!r} does not exist")


def _remove(doc: Any, path: str) -> Any:
    parent, key = _parent(doc, path)
    value = _get(doc, path)
    if isinstance(parent, list):
        del parent[int(key)]
    else:
        del parent[key]
    return value


def _add(doc: Any, path: str, value: Any) -> None:
    parent, key = _parent(doc, path)
    if isinstance(parent, dict):
        parent[key] = copy.deepcopy(value)
    elif isinstance(parent, list) and (key == "-" or (key.isdigit() and int(key) <= len(parent))):
        parent.insert(len(parent) if key == "-" else int(key), copy.deepcopy(value))
    else:
        raise ValueError(f"path {path!r} cannot take a value")


def json_patch(target: Obj, ops: Any) -> Obj:
    """RFC 6902 JSON patch: every operation or none; ValueError names the one that failed."""
    if not isinstance(ops, list):
        raise ValueError("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        if kind == "add":
            _add(doc, path, op.get("value"))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            _remove(doc, path)
            _add(doc, path, op.get("value"))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise ValueError(f"testing value {path} failed: test failed")
        elif kind in ("move", "copy"):
            value = _get(doc, op.get("from", ""))
            if kind == "move":
                _remove(doc, op.get("from", ""))
            _add(doc, path, value)
        else:
            raise ValueError(f"unknown JSON patch operation {kind!r}")
    return doc


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def parse_selector(text: str) -> list[tuple[str, str, str]]:
    """labelSelector -> [(op, key, value)], op in =, !=, exists, !exists."""
    reqs: list[tuple[str, str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "!=" in part:
            k, v = part.split("!=", 1)
            reqs.append(("!=", k.strip(), v.strip()))
        elif "==" in part:
            k, v = part.split("==", 1)
            reqs.append(("=", k.strip(), v.strip()))
        elif "=" in part:
            k, v = part.split("=", 1)
            reqs.append(("=", k.strip(), v.strip()))
        elif part.startswith("!"):
            reqs.append(("!exists", part[1:].strip(), ""))
        else:
            reqs.append(("exists", part, ""))
    return reqs


def parse_fields(text: str, plural: str) -> list[tuple[str, str, str]] | str:
    """fieldSelector -> [(op, field, value)], or the 400 message for an unsupported field."""
    allowed = FIELD_LABELS.get(plural, DEFAULT_FIELDS)
    reqs: list[tuple[str, str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        op = "!=" if "!=" in part else "="
        k, _, v = part.replace("==", "=").partition("!=" if op == "!=" else "=")
        if not _ or k.strip() not in allowed:
            return (
                f'"{k.strip()}" is not a known field selector: only "{", ".join(sorted(allowed))}"'
            )
        reqs.append((op, k.strip(), v.strip()))
    return reqs


def field_value(obj: Obj, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return "" if cur is None else str(cur)


def fields_match(obj: Obj, reqs: list[tuple[str, str, str]]) -> bool:
    for op, k, v in reqs:
        have = field_value(obj, k)
        if (op == "=" and have != v) or (op == "!=" and have == v):
            return False
    return True


def matches(obj: Obj, reqs: list[tuple[str, str, str]]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for op, k, v in reqs:
        if op == "=" and labels.get(k) != v:
            return False
        if op == "!=" and labels.get(k) == v:
            return False
        if op == "exists" and k not in labels:
            return False
        if op == "!exists" and k in labels:
            return False
    return True


@dataclass
class Route:
    res: ResKey
    namespace: str | None  # None = all namespaces / cluster scoped
    name: str | None
    subresource: str = ""  # "status": only the object's status is written

    @property
    def group(self) -> str:
        return self.res[0].rsplit("/", 1)[0] if "/" in self.res[0] else ""


@dataclass
class Watcher:
    res: ResKey
    namespace: str | None
    selector: list[tuple[str, str, str]]
    bookmarks: bool
    fields: list[tuple[str, str, str]] = field(default_factory=list)
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    def selects(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        ns = obj["metadata"].get("namespace")
        if self.namespace is not None and ns != self.namespace:
            return False
        return matches(obj, self.selector) and fields_match(obj, self.fields)

    def event(self, kind: str, obj: Obj, prev: Obj | None, rv: int) -> Obj | None:
        """The event this watcher sees for a change, as the watch cache filters it."""
        now = kind != "DELETED" and self.selects(obj)
        before = self.selects(prev if kind != "DELETED" else obj)
        if now and before:
            return {"type": "MODIFIED", "object": obj}
        if now:
            return {"type": "ADDED", "object": obj}
        if before:
            gone = copy.deepcopy(prev if kind != "DELETED" and prev is not None else obj)
            gone["metadata"]["resourceVersion"] = str(rv)
            return {"type": "DELETED", "object": gone}
        return None


def parse_path(path: str) -> Route | None:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        gv, rest = parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    if len(rest) == 5 and rest[0] == "namespaces" and rest[4] == "status":
        return Route((gv, rest[2]), rest[1], rest[3], "status")
    if len(rest) >= 3 and rest[0] == "namespaces":
        return Route((gv, rest[2]), rest[1], rest[3] if len(rest) > 3 else None)
    if len(rest) in (1, 2):
        return Route((gv, rest[0]), None, rest[1] if len(rest) == 2 else None)
    return None


def status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def now_rfc3339(offset_s: float = 0.0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + offset_s))


class FakeApiServer:
    """See the module docstring: a stand-in for tests, never a real API server."""

    def __init__(
        self,
        bookmark_interval: float | None = None,
        gone_as_http: bool = False,
        validate: bool = True,
        termination_s: float | None = 0.3,
        port: int = 0,
    ):
        self.bookmark_interval = bookmark_interval
        self.gone_as_http = gone_as_http
        self.validate = validate
        # Real seconds a Terminating pod stays (its grace period, scaled for tests);
        # None = until `finish_terminating()`.
        self.termination_s = termination_s
        self.tokens: set[str] | None = None  # None = no authentication
        # RBAC, opt-in (tests/kube/rbac_authz.py): token -> user, and the authorizer that
        # decides every request (403 Forbidden otherwise); other tokens = `default_user`.
        self.authorizer: Any = None
        self.users: dict[str, str] = {}
        self.default_user = "system:anonymous"
        self.forbidden: list[Obj] = []  # 403 Status bodies sent
        # Kueue installed, opt-in (tests/kube/kueue_model.py): with `manageJobsWithoutQueueName`
        # its managedJobsNamespaceSelector as a label selector; None = no Kueue.
        self.kueue_namespace_selector: str | None = None
        self.rv = 1
        self.compacted_rv = 0
        self.store: dict[ResKey, dict[tuple[str, str], Obj]] = {}
        self.log: list[tuple[int, ResKey, str, Obj, Obj | None]] = []
        self.watchers: list[Watcher] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.deletes: list[tuple[str, str]] = []  # (path, propagationPolicy)
        self.patches: list[tuple[str, str, Any]] = []  # (path, content type, body)
        self.patch_failures: list[str] = []  # why each refused JSON patch failed
        # KubeRay installed, opt-in (tests/kube/kuberay_model.py); None = no KubeRay.
        self.kuberay: kuberay_model.KubeRay | None = None
        self.rejected: list[Obj] = []  # 422 Status bodies sent
        self.unauthorized = 0
        self.missing_groups: set[str] = set()
        self.down = False  # an outage: every request answers 503 ServiceUnavailable
        self.latency_s = 0.0  # added to every request but a watch
        self.pod_logs: dict[tuple[str, str], str] = {}  # (namespace, pod) -> container output
        self._failures: list[tuple[str, str, int, float | None]] = []
        self._terminating: dict[tuple[ResKey, str, str], float] = {}  # -> remove at (monotonic)
        self._job_clock: Any = None  # set by run_job_controller()
        self.job_controller_passes = 0
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = port
        # Consistent paginated lists: token id -> (the list's revision, its selected items).
        self._snapshots: dict[int, tuple[int, list[Obj]]] = {}
        self._snapshot_ids = 0
        self._foreground: set[tuple[ResKey, tuple[str, str]]] = set()
        self.max_inflight: int | None = None  # APF: more non-watch requests in flight -> 429
        self.retry_after_s = 1  # what an APF 429 asks for
        self.latency_s = 0.0  # added to every non-watch answer
        self.inflight = 0
        self.peak_inflight = 0
        self.throttled = 0  # APF 429s sent

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        if self.bookmark_interval:
            self._tasks.append(asyncio.create_task(self._bookmark_loop()))
        self._tasks.append(asyncio.create_task(self._termination_loop()))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for w in self.watchers:
            w.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- direct state manipulation (what controllers/kubelets would do) --------------------
    def put(self, path: str, obj: Obj, silent: bool = False) -> Obj:
        """Create or replace an object at a collection path (e.g. /api/v1/nodes or
        /api/v1/namespaces/ns/pods) and notify watchers. `silent` skips the watchers and the
        history: a change made while a client was away, whose history was then compacted.
        An object being deleted whose finalizers are now all gone is removed."""
        route = parse_path(path)
        assert route is not None, path
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        ns = route.namespace or meta.get("namespace") or ""
        if ns and route.res[1] not in CLUSTER_SCOPED:
            meta["namespace"] = ns
        key = (ns if route.res[1] not in CLUSTER_SCOPED else "", meta["name"])
        bucket = self.store.setdefault(route.res, {})
        old = bucket.get(key)
        meta.setdefault("uid", (old or {}).get("metadata", {}).get("uid") or str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        obj.setdefault("kind", KINDS.get(route.res[1], "Object"))
        obj.setdefault("apiVersion", route.res[0])
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        bucket[key] = obj
        if not silent:
            self._notify(route.res, "MODIFIED" if old is not None else "ADDED", obj, old)
        last_finalizer_gone = (
            old is not None and old["metadata"].get("finalizers") and not meta.get("finalizers")
        )
        pending = (route.res, *key) in self._terminating
        if meta.get("deletionTimestamp") and last_finalizer_gone and not pending:
            self._remove(route.res, key)
        return obj

    def get(self, path: str) -> Obj | None:
        route = parse_path(path)
        assert route is not None and route.name is not None, path
        ns = route.namespace or ""
        return self.store.get(route.res, {}).get((ns, route.name))

    def remove(self, path: str, silent: bool = False) -> Obj | None:
        """Delete the object at an item path at once and notify watchers (see `put` for
        silent): what the API server does when a kubelet confirms a pod is gone."""
        route = parse_path(path)
        assert route is not None and route.name is not None, path
        if silent:
            return self.store.get(route.res, {}).pop((route.namespace or "", route.name), None)
        return self._remove(route.res, (route.namespace or "", route.name))

    def delete(self, path: str, policy: str = "Background", grace: int | None = None) -> Obj | None:
        """What a DELETE request does (graceful, finalizers, propagation), for controllers."""
        route = parse_path(path)
        assert route is not None and route.name is not None, path
        return self._delete(route, policy, grace)

    def run_job_controller(self, clock: Any = time.time) -> None:
        """Enforce batch Jobs' activeDeadlineSeconds as the Job controller does (see the
        module docstring); `clock` gives unix seconds, so a test can move time itself."""
        self._job_clock = clock
        self.job_controller_passes = 0
        self._tasks.append(asyncio.create_task(self._job_deadline_loop()))

    async def _job_deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.02)
            self.enforce_job_deadlines()
            self.job_controller_passes += 1

    def enforce_job_deadlines(self) -> None:
        now = self._job_clock()
        for (ns, _), job in list(self.store.get(JOBS_RES, {}).items()):
            deadline = (job.get("spec") or {}).get("activeDeadlineSeconds")
            status = job.get("status") or {}
            started = status.get("startTime")
            if (
                not isinstance(deadline, int)
                or not started
                or job["metadata"].get("deletionTimestamp")
            ):
                continue
            conditions = status.get("conditions") or []
            if any(c.get("type") in ("Complete", "Failed") for c in conditions):
                continue
            start = calendar.timegm(time.strptime(started, "%Y-%m-%dT%H:%M:%SZ"))
            if now < start + deadline:
                continue
            message = "Job was active longer than specified deadline"
            failed = {
                "status": "True",
                "reason": "DeadlineExceeded",
                "message": message,
                "lastTransitionTime": now_rfc3339(),
            }
            job = copy.deepcopy(job)
            job["status"] = {
                **status,
                "active": 0,
                "conditions": [
                    *conditions,
                    {"type": "FailureTarget", **failed},
                    {"type": "Failed", **failed},
                ],
            }
            self.put(f"/apis/batch/v1/namespaces/{ns}/jobs", job)
            uid = job["metadata"]["uid"]
            for (pns, pname), pod in list(self.store.get(("v1", "pods"), {}).items()):
                owners = pod["metadata"].get("ownerReferences") or []
                if any(o.get("uid") == uid for o in owners):
                    self.delete(f"/api/v1/namespaces/{pns}/pods/{pname}")

    def items(self, gv: str, plural: str) -> list[Obj]:
        return list(self.store.get((gv, plural), {}).values())

    def terminating(self, gv: str = "v1", plural: str = "pods") -> list[Obj]:
        return [o for o in self.items(gv, plural) if o["metadata"].get("deletionTimestamp")]

    def finish_terminating(self) -> None:
        """Every Terminating pod is confirmed gone (as the kubelet does after its grace)."""
        for res, ns, name in list(self._terminating):
            self._terminating.pop((res, ns, name), None)
            obj = self.store.get(res, {}).get((ns, name))
            if obj is not None and not obj["metadata"].get("finalizers"):
                self._remove(res, (ns, name))

    def compact(self) -> None:
        """Forget history: any watch from an older resourceVersion now gets 410 Gone."""
        self.compacted_rv = self.rv
        self.log.clear()
        self._snapshots.clear()

    def expire_watches(self) -> None:
        """Send ERROR 410 on every open watch (as when the server's cache window passes)."""
        self.compact()
        line = self._line({"type": "ERROR", "object": status(410, "Expired", "too old")})
        for w in self.watchers:
            w.queue.put_nowait(line)
            w.queue.put_nowait(None)

    def close_watches(self, plural: str | None = None) -> None:
        """End open watches normally (as a server-side timeout does)."""
        for w in self.watchers:
            if plural is None or w.res[1] == plural:
                w.queue.put_nowait(None)

    def reset_watches(self, plural: str | None = None) -> None:
        """Drop open watch connections mid-stream (a load balancer or apiserver restart)."""
        for w in self.watchers:
            if plural is None or w.res[1] == plural:
                w.queue.put_nowait(RESET)

    def send_raw(self, line: bytes, plural: str | None = None) -> None:
        for w in self.watchers:
            if plural is None or w.res[1] == plural:
                w.queue.put_nowait(line)

    def bookmark(self) -> None:
        for w in self.watchers:
            if w.bookmarks:
                w.queue.put_nowait(self._bookmark_line(w.res))

    def fail_next(
        self,
        method: str,
        path_prefix: str,
        status_code: int = 500,
        retry_after: float | None = None,
    ) -> None:
        """The next matching request answers `status_code` (429 may carry Retry-After)."""
        self._failures.append((method, path_prefix, status_code, retry_after))

    def clear_failures(self) -> None:
        """Forget the failures `fail_next` queued that no request has taken yet."""
        self._failures.clear()

    def revoke(self, token: str) -> None:
        """The token expires: every later request carrying it is a 401."""
        if self.tokens is not None:
            self.tokens.discard(token)

    def watch_count(self, plural: str) -> int:
        return sum(1 for w in self.watchers if w.res[1] == plural)

    # -- internals ----------------------------------------------------------------------
    @staticmethod
    def _line(obj: Obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"

    def _bookmark_line(self, res: ResKey) -> bytes:
        return self._line(
            {
                "type": "BOOKMARK",
                "object": {
                    "kind": KINDS.get(res[1], "Object"),
                    "apiVersion": res[0],
                    "metadata": {"resourceVersion": str(self.rv)},
                },
            }
        )

    async def _bookmark_loop(self) -> None:
        assert self.bookmark_interval
        while True:
            await asyncio.sleep(self.bookmark_interval)
            self.bookmark()

    async def _termination_loop(self) -> None:
        """Terminating pods whose (scaled) grace ran out are confirmed gone."""
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            for (res, ns, name), at in list(self._terminating.items()):
                if at <= now:
                    self._terminating.pop((res, ns, name), None)
                    obj = self.store.get(res, {}).get((ns, name))
                    if obj is not None and not obj["metadata"].get("finalizers"):
                        self._remove(res, (ns, name))
            self._finish_foreground()

    def _notify(self, res: ResKey, kind: str, obj: Obj, prev: Obj | None) -> None:
        snap = copy.deepcopy(obj)
        self.log.append((self.rv, res, kind, snap, prev))
        for w in self.watchers:
            if w.res != res:
                continue
            ev = w.event(kind, snap, prev, self.rv)
            if ev is not None:
                w.queue.put_nowait(self._line(ev))

    def _remove(self, res: ResKey, key: tuple[str, str]) -> Obj | None:
        obj = self.store.get(res, {}).pop(key, None)
        if obj is None:
            return None
        self._terminating.pop((res, *key), None)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._notify(res, "DELETED", obj, None)
        return obj

    def _dependents(self, uid: str) -> list[tuple[ResKey, tuple[str, str]]]:
        out = []
        for res, objs in self.store.items():
            for key, o in objs.items():
                owners = o.get("metadata", {}).get("ownerReferences") or []
                if any(ref.get("uid") == uid for ref in owners):
                    out.append((res, key))
        return out

    def _finish_foreground(self) -> None:
        """Owners deleted in the foreground lose the finalizer once their dependents are
        gone (only those are looked at: a scale test's store holds 150,000 pods)."""
        for res, key in list(self._foreground):
            o = self.store.get(res, {}).get(key)
            fins = (o or {}).get("metadata", {}).get("finalizers") or []
            if o is None or "foregroundDeletion" not in fins:
                self._foreground.discard((res, key))
            elif not self._dependents(o["metadata"]["uid"]):
                self._foreground.discard((res, key))
                o = copy.deepcopy(o)
                o["metadata"]["finalizers"] = [f for f in fins if f != "foregroundDeletion"]
                self.put(self._collection(res, key[0]), o)

    @staticmethod
    def _collection(res: ResKey, ns: str) -> str:
        base = f"/api/{res[0]}" if "/" not in res[0] else f"/apis/{res[0]}"
        return f"{base}/namespaces/{ns}/{res[1]}" if ns else f"{base}/{res[1]}"

    def _delete(self, route: Route, policy: str, grace: int | None = None) -> Obj | None:
        """Graceful deletion, as the API server does it (see the module docstring)."""
        ns = route.namespace or ""
        key = (ns, route.name or "")
        obj = self.store.get(route.res, {}).get(key)
        if obj is None:
            return None
        meta = obj["metadata"]
        uid = meta.get("uid")
        is_pod = route.res == ("v1", "pods")
        bound = is_pod and bool((obj.get("spec") or {}).get("nodeName"))
        if grace is None and bound:
            grace = int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and self._dependents(uid):
            finalizers.append("foregroundDeletion")
            self._foreground.add((route.res, key))
        out: Obj | None = obj
        if meta.get("deletionTimestamp"):
            pass  # already being deleted: nothing new
        elif finalizers or (bound and grace):
            changed = copy.deepcopy(obj)
            changed["metadata"]["finalizers"] = finalizers or None
            changed["metadata"]["deletionTimestamp"] = now_rfc3339(grace or 0)
            changed["metadata"]["deletionGracePeriodSeconds"] = grace or 0
            if not finalizers:
                del changed["metadata"]["finalizers"]
            if bound and grace and self.termination_s is not None:
                remove_at = time.monotonic() + min(float(grace), self.termination_s)
                self._terminating[(route.res, *key)] = remove_at
            elif bound and grace:
                self._terminating[(route.res, *key)] = float("inf")
            out = self.put(self._collection(route.res, ns), changed)
        else:
            out = self._remove(route.res, key)
        if policy != "Orphan" and uid:
            for res, dkey in self._dependents(uid):
                self._delete(Route(res, dkey[0] or None, dkey[1]), "Background")
        return out

    def _take_failure(self, method: str, path: str) -> tuple[int, float | None] | None:
        for i, (m, prefix, code, retry) in enumerate(self._failures):
            if m == method and path.startswith(prefix):
                del self._failures[i]
                return code, retry
        return None

    def _invalid(self, obj: Obj, old: Obj | None) -> web.Response | None:
        """The 422 for a create or update. An update is judged on what it changes: an object
        a test put directly (as a controller would, unvalidated) keeps its own flaws."""
        if not self.validate:
            return None
        found = causes(obj, old)
        if old is not None and found:
            before = {str(c) for c in causes(old)}
            found = [c for c in found if str(c) not in before]
        if not found:
            return None
        body = invalid_status(obj, found)
        self.rejected.append(body)
        return web.json_response(body, status=422)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("1", "true"):
            return await self._serve(request)
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            # What API priority and fairness answers when a priority level's queues are full.
            self.throttled += 1
            self.requests.append((request.method, request.path, dict(request.query)))
            body = status(429, "TooManyRequests", "Too many requests, please try again later.")
            body["details"] = {"retryAfterSeconds": self.retry_after_s}
            headers = {"Retry-After": str(self.retry_after_s)}
            return web.json_response(body, status=429, headers=headers)
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            return await self._serve(request)
        finally:
            self.inflight -= 1

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        query = dict(request.query)
        self.requests.append((request.method, path, query))
        if self.tokens is not None:
            auth = request.headers.get("Authorization", "")
            if not auth.startswith("Bearer ") or auth[7:] not in self.tokens:
                self.unauthorized += 1
                return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        refused = self._authorize(request, query)
        if refused is not None:
            return refused
        if self.latency_s > 0 and query.get("watch") not in ("1", "true"):
            await asyncio.sleep(self.latency_s)
        if self.down:
            self.reset_watches()
            unavailable = status(503, "ServiceUnavailable", "the server is currently unavailable")
            return web.json_response(unavailable, status=503)
        failure = self._take_failure(request.method, path)
        if failure is not None:
            code, retry = failure
            reasons = {429: "TooManyRequests", 504: "Timeout", 401: "Unauthorized"}
            headers = {"Retry-After": f"{retry:g}"} if retry is not None else None
            return web.json_response(
                status(code, reasons.get(code, "InternalError"), "injected"),
                status=code,
                headers=headers,
            )
        if request.method == "GET" and path.endswith("/log") and "/pods/" in path:
            return self._pod_log(path, query)
        if request.method == "POST" and path.endswith("/eviction") and "/pods/" in path:
            return self._evict(path, await request.json())
        route = parse_path(path)
        if route is None:
            return web.json_response(status(404, "NotFound", f"no route {path}"), status=404)
        if route.group in self.missing_groups:
            return web.json_response(
                status(404, "NotFound", f"the server could not find {path}"), status=404
            )
        if request.method == "GET":
            if route.name is not None:
                obj = self.store.get(route.res, {}).get((route.namespace or "", route.name))
                if obj is None:
                    msg = f'{route.res[1]} "{route.name}" not found'
                    return web.json_response(status(404, "NotFound", msg), status=404)
                return web.json_response(obj)
            fields = parse_fields(query.get("fieldSelector", ""), route.res[1])
            if isinstance(fields, str):
                return web.json_response(status(400, "BadRequest", fields), status=400)
            if query.get("watch") in ("1", "true"):
                return await self._watch(request, route, query, fields)
            return self._list(route, query, fields)
        if request.method == "POST" and route.name is None:
            body = await request.json()
            name = (body.get("metadata") or {}).get("name")
            if not name:
                return web.json_response(status(422, "Invalid", "name required"), status=422)
            refused = self._invalid(body, None)
            if refused is not None:
                return refused
            refused = self._admit_owners(request, route, body)
            if refused is not None:
                return refused
            refused = self._admit_quota(request, route, body)
            if refused is not None:
                return refused
            if (route.namespace or "", name) in self.store.get(route.res, {}):
                msg = f"{route.res[1]} {name!r} already exists"
                return web.json_response(status(409, "AlreadyExists", msg), status=409)
            if route.res == JOBS_RES and self._job_clock is not None:
                # the Job controller's first sync: the clock activeDeadlineSeconds counts from
                started = time.gmtime(self._job_clock())
                body.setdefault("status", {})["startTime"] = time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", started
                )
            self._kueue_default(route, body)
            obj = self.put(path, body)
            if self.kuberay is not None and route.res == kuberay_model.RAYJOBS:
                self.kuberay.rayjob_created(self, copy.deepcopy(obj))
            return web.json_response(obj, status=201)
        if request.method == "PATCH" and route.name is not None:
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            custom = route.res[0] not in BUILT_IN
            if ctype not in (MERGE, JSON_PATCH) and (custom or ctype != STRATEGIC):
                accepted = CRD_PATCH_TYPES if custom else BUILT_IN_PATCH_TYPES
                msg = f"{UNKNOWN_FORMAT}{', '.join(accepted)}"
                return web.json_response(status(415, "UnsupportedMediaType", msg), status=415)
            body = await request.json()
            self.patches.append((path, ctype, body))
            collection = path.removesuffix("/status").rsplit("/", 1)[0]
            old = self.store.get(route.res, {}).get((route.namespace or "", route.name))
            if old is None:
                return web.json_response(status(404, "NotFound", "not found"), status=404)
            # A resourceVersion in the patch is a precondition, as on a real server.
            meta = body.get("metadata") if isinstance(body, dict) else None
            wanted = (meta or {}).get("resourceVersion")
            if wanted is not None and wanted != old["metadata"]["resourceVersion"]:
                msg = (
                    "the object has been modified; please apply your changes to the latest version"
                )
                return web.json_response(status(409, "Conflict", msg), status=409)
            if ctype == JSON_PATCH:
                try:
                    new = json_patch(old, body)
                except (ValueError, TypeError, AttributeError) as exc:
                    self.patch_failures.append(str(exc))
                    failed = status(422, "Invalid", JSON_PATCH_FAILED)
                    failed["details"] = {}
                    return web.json_response(failed, status=422)
                if route.subresource == "status":
                    new = {**old, "status": new.get("status")}
            else:
                if route.subresource == "status":  # the status subresource writes status only
                    body = {"status": body.get("status")}
                new = merge_patch(old, body)
            refused = self._invalid(new, old)
            if refused is not None:
                return refused
            return web.json_response(self.put(collection, new))
        if request.method == "DELETE" and route.name is not None:
            policy = query.get("propagationPolicy", "")
            grace_text = query.get("gracePeriodSeconds", "")
            self.deletes.append((path, policy))
            obj = self._delete(
                route, policy or "Background", int(grace_text) if grace_text.isdigit() else None
            )
            if obj is None:
                return web.json_response(status(404, "NotFound", "not found"), status=404)
            return web.json_response(obj)
        return web.json_response(status(405, "MethodNotAllowed", request.method), status=405)

    def _user(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else ""
        return self.users.get(token, self.default_user)

    def _authorize(self, request: web.Request, query: dict[str, str]) -> web.Response | None:
        """RBAC: the real 403 Status for a request the shipped roles do not allow."""
        if self.authorizer is None:
            return None
        attrs = request_attributes(self._user(request), request.method, request.path, query)
        if self.authorizer.allows(attrs):
            return None
        body: Obj = self.authorizer.forbidden(attrs)
        self.forbidden.append(body)
        return web.json_response(body, status=403)

    def _admit_owners(self, request: web.Request, route: Route, obj: Obj) -> web.Response | None:
        """OwnerReferencesPermissionEnforcement (with RBAC on): blockOwnerDeletion needs
        update on the owner's finalizers."""
        if self.authorizer is None:
            return None
        user = self._user(request)
        if self.authorizer.owner_refusal(user, route.namespace or "", obj) is None:
            return None
        group = route.res[0].rsplit("/", 1)[0] if "/" in route.res[0] else ""
        name = obj["metadata"]["name"]
        created = Attributes(user, "create", group, route.res[1], "", route.namespace or "", name)
        body = owner_forbidden(created)
        self.forbidden.append(body)
        return web.json_response(body, status=403)

    def _admit_quota(self, request: web.Request, route: Route, obj: Obj) -> web.Response | None:
        """ResourceQuota admission (tests/kube/quota_admission.py): the namespace's quotas
        refuse a create that would exceed one of them, else are charged with it."""
        namespace = route.namespace or ""
        quotas = [
            copy.deepcopy(q)
            for (ns, _), q in self.store.get(QUOTAS_RES, {}).items()
            if namespace and ns == namespace
        ]
        if not quotas:
            return None
        why, charged = quota_admission.admit(quotas, route.res, obj)
        if why is None:
            for quota in charged:
                self.put(f"/api/v1/namespaces/{namespace}/resourcequotas", quota)
            return None
        group = route.res[0].rsplit("/", 1)[0] if "/" in route.res[0] else ""
        name = obj["metadata"]["name"]
        created = Attributes(
            self._user(request), "create", group, route.res[1], "", namespace, name
        )
        body = forbidden_status(created, why)
        self.forbidden.append(body)
        return web.json_response(body, status=403)

    def _kueue_default(self, route: Route, obj: Obj) -> None:
        """Kueue's job webhook: a job it manages is created suspended."""
        if self.kueue_namespace_selector is None or route.res not in kueue_model.SUSPEND_FIELDS:
            return
        namespace = self.store.get(("v1", "namespaces"), {}).get(("", route.namespace or ""))
        in_scope = matches(namespace or {}, parse_selector(self.kueue_namespace_selector))
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if kueue_model.QUEUE_LABEL in labels or in_scope:
            kueue_model.suspend(route.res, obj)

    def _evict(self, path: str, body: Any) -> web.Response:
        """`POST /api/v1/namespaces/<ns>/pods/<name>/eviction` as the eviction subresource
        answers it (kubernetes/kubernetes pkg/registry/core/pod/storage/eviction.go): a pod
        that is not running is deleted at once; otherwise its PodDisruptionBudget (matched by
        `spec.selector.matchLabels`) must have `status.disruptionsAllowed` left, which is
        decremented (429 TooManyRequests with a DisruptionBudget cause when none is left, 500
        for more than one budget). The pod gets the DisruptionTarget condition
        (EvictionByEvictionAPI) and is deleted gracefully; the answer is 201 with a Success
        Status."""
        parts = [p for p in path.split("/") if p]
        if len(parts) != 7 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
            return web.json_response(status(404, "NotFound", f"no route {path}"), status=404)
        namespace, name = parts[3], parts[5]
        if not isinstance(body, dict) or body.get("kind") != "Eviction":
            msg = "not a Eviction object"
            return web.json_response(status(400, "BadRequest", msg), status=400)
        if (body.get("metadata") or {}).get("name") != name:
            msg = "name in URL does not match name in Eviction object"
            return web.json_response(status(400, "BadRequest", msg), status=400)
        obj = self.store.get(("v1", "pods"), {}).get((namespace, name))
        if obj is None:
            msg = f'pods "{name}" not found'
            return web.json_response(status(404, "NotFound", msg), status=404)
        phase = (obj.get("status") or {}).get("phase")
        deleting = bool(obj["metadata"].get("deletionTimestamp"))
        if phase not in ("Succeeded", "Failed", "Pending") and not deleting:
            refused = self._take_disruption(namespace, obj)
            if refused is not None:
                return refused
            marked = copy.deepcopy(obj)
            conditions = marked.setdefault("status", {}).setdefault("conditions", [])
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                }
            )
            self.put(f"/api/v1/namespaces/{namespace}/pods", marked)
        self._delete(Route(("v1", "pods"), namespace, name), "Background")
        done = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        return web.json_response(done, status=201)

    def _take_disruption(self, namespace: str, pod_obj: Obj) -> web.Response | None:
        labels = pod_obj["metadata"].get("labels") or {}
        budgets = []
        for (ns, _), pdb in self.store.get(("policy/v1", "poddisruptionbudgets"), {}).items():
            wanted = ((pdb.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            if ns == namespace and wanted and all(labels.get(k) == v for k, v in wanted.items()):
                budgets.append(pdb)
        if len(budgets) > 1:
            msg = (
                "This pod has more than one PodDisruptionBudget, which the eviction "
                "subresource does not support."
            )
            return web.json_response(status(500, "", msg), status=500)
        if not budgets:
            return None
        pdb = budgets[0]
        st = pdb.get("status") or {}
        if int(st.get("disruptionsAllowed", 0)) <= 0:
            body = status(
                429,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
            )
            body["details"] = {
                "causes": [
                    {
                        "reason": "DisruptionBudget",
                        "message": f"The disruption budget {pdb['metadata']['name']} needs "
                        f"{st.get('desiredHealthy', 0)} healthy pods and has "
                        f"{st.get('currentHealthy', 0)} currently",
                    }
                ]
            }
            return web.json_response(body, status=429)
        taken = copy.deepcopy(pdb)
        taken["status"]["disruptionsAllowed"] = int(st["disruptionsAllowed"]) - 1
        self.put(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", taken)
        return None

    def _pod_log(self, path: str, query: dict[str, str]) -> web.Response:
        """`GET /api/v1/namespaces/<ns>/pods/<name>/log`: text/plain, tailLines and
        limitBytes as the real server applies them; 404 for a pod that does not exist."""
        parts = [p for p in path.split("/") if p]
        if len(parts) != 7 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
            return web.json_response(status(404, "NotFound", f"no route {path}"), status=404)
        namespace, name = parts[3], parts[5]
        if (namespace, name) not in self.store.get(("v1", "pods"), {}):
            msg = f'pods "{name}" not found'
            return web.json_response(status(404, "NotFound", msg), status=404)
        text = self.pod_logs.get((namespace, name), "")
        for key in ("tailLines", "limitBytes"):
            raw = query.get(key)
            if raw is not None and (not raw.isdigit() or (key == "limitBytes" and raw == "0")):
                msg = f"{key}: Invalid value: {raw!r}: must be a positive integer"
                return web.json_response(status(400, "BadRequest", msg), status=400)
        if "tailLines" in query:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[len(lines) - int(query["tailLines"]) :]) if lines else ""
        data = text.encode()
        if "limitBytes" in query:
            data = data[: int(query["limitBytes"])]
        return web.Response(body=data, content_type="text/plain")

    def _selected(
        self, route: Route, query: dict[str, str], fields: list[tuple[str, str, str]]
    ) -> list[Obj]:
        reqs = parse_selector(query.get("labelSelector", ""))
        out = []
        for (ns, _), obj in sorted(self.store.get(route.res, {}).items()):
            if route.namespace is not None and ns != route.namespace:
                continue
            if matches(obj, reqs) and fields_match(obj, fields):
                out.append(obj)
        return out

    def _list(
        self, route: Route, query: dict[str, str], fields: list[tuple[str, str, str]]
    ) -> web.Response:
        limit = int(query.get("limit", "0") or 0)
        if query.get("resourceVersion") == "0":
            limit = 0  # served from the watch cache: the real server ignores the limit
        token = query.get("continue", "")
        if token:
            try:
                decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                snap_id, start, at_rv = (int(x) for x in decoded["start"].split(":"))
                if int(decoded["rv"]) != at_rv:
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                msg = "continue key is not valid: incorrect encoded start resourceVersion"
                return web.json_response(status(400, "BadRequest", msg), status=400)
            snap = self._snapshots.get(snap_id)
            if at_rv < self.compacted_rv or snap is None:
                return web.json_response(status(410, "Expired", EXPIRED), status=410)
            list_rv, items = snap
        else:
            list_rv, items, start = self.rv, self._selected(route, query, fields), 0
        page = items[start : start + limit] if limit else items[start:]
        meta: Obj = {"resourceVersion": str(list_rv)}
        if limit and start + limit < len(items):
            if not token:
                self._snapshot_ids += 1
                snap_id = self._snapshot_ids
                self._snapshots[snap_id] = (list_rv, items)
                while len(self._snapshots) > 64:  # abandoned lists: the oldest expire
                    del self._snapshots[min(self._snapshots)]
            start_key = f"{snap_id}:{start + limit}:{list_rv}"
            raw = {"v": "meta.k8s.io/v1", "rv": list_rv, "start": start_key}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(raw).encode()).decode()
        elif token:
            self._snapshots.pop(snap_id, None)
        kind = KINDS.get(route.res[1], "Object") + "List"
        body = {"kind": kind, "apiVersion": route.res[0], "metadata": meta, "items": page}
        return web.Response(body=json.dumps(body, separators=(",", ":")), content_type=JSON)

    async def _watch(
        self,
        request: web.Request,
        route: Route,
        query: dict[str, str],
        fields: list[tuple[str, str, str]],
    ) -> web.StreamResponse:
        rv_text = query.get("resourceVersion", "")
        since = int(rv_text) if rv_text.isdigit() else 0
        too_old = since and since < self.compacted_rv
        if too_old and self.gone_as_http:
            return web.json_response(status(410, "Expired", "too old resource version"), status=410)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if too_old:
            await resp.write(
                self._line({"type": "ERROR", "object": status(410, "Expired", "too old")})
            )
            return resp
        w = Watcher(
            route.res,
            route.namespace,
            parse_selector(query.get("labelSelector", "")),
            query.get("allowWatchBookmarks") in ("true", "1"),
            fields,
        )
        # Replay: from the log after `since`, or (no version) the current state as ADDED.
        if since:
            for rv, res, kind, obj, prev in self.log:
                if rv > since and res == route.res:
                    ev = w.event(kind, obj, prev, rv)
                    if ev is not None:
                        await resp.write(self._line(ev))
        else:
            for obj in self._selected(route, query, fields):
                await resp.write(self._line({"type": "ADDED", "object": obj}))
        timeout = float(query.get("timeoutSeconds", "1800") or 1800)
        deadline = time.monotonic() + timeout
        self.watchers.append(w)
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    line = await asyncio.wait_for(w.queue.get(), timeout=left)
                except TimeoutError:
                    break
                if line is None:
                    break
                if line == RESET:
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                await resp.write(line)
        except ConnectionResetError:
            return resp
        finally:
            self.watchers.remove(w)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp
