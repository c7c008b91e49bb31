"""A FAKE Kubernetes API server: a test stand-in, NOT a real API server.

No real API server can be installed in this workplace (and kmock's watch does not work with
kubernetes-asyncio), so the kube backend is tested against this small aiohttp app. The client
under test is the real kubernetes-asyncio `ApiClient`, pointed at http://127.0.0.1:<port>.

It implements only what the backend uses, with the API server's observable behaviour:

* generic storage per resource path: `/api/v1/...` and `/apis/<group>/<version>/...`,
  cluster-scoped (`nodes`) and namespaced (`pods`, `services`, `jobs`, CRDs), plus
  all-namespace lists (`/api/v1/pods`);
* GET list with `labelSelector` (=, ==, !=, exists, !exists), `limit` + `continue`
  pagination, and the list's `metadata.resourceVersion`;
* GET `?watch=true` streaming one JSON event per line: replay from `resourceVersion`, then
  live events; `allowWatchBookmarks` -> BOOKMARK events (on demand with `bookmark()`, or
  every `bookmark_interval` seconds); `timeoutSeconds`; a too-old resourceVersion (older than
  `compact()`) gives 410 Gone, as an ERROR event (like the real server) or, with
  `gone_as_http=True`, as an HTTP 410;
* POST (409 AlreadyExists), PATCH (JSON merge patch for merge- and strategic-merge patch),
  DELETE (records `propagationPolicy`; cascades to objects whose ownerReferences name the
  deleted uid unless the policy is Orphan);
* fault injection: `expire_watches()` (ERROR 410 on every open watch), `send_raw()` (garbage
  lines), `fail_next()` (an HTTP error for the next matching request), `missing_groups`
  (a CRD that is not installed answers 404).

Everything binds to 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Obj = dict[str, Any]
ResKey = tuple[str, str]  # (group/version, plural), e.g. ("v1", "pods")

CLUSTER_SCOPED = {"nodes", "namespaces"}
KINDS = {
    "nodes": "Node",
    "pods": "Pod",
    "services": "Service",
    "jobs": "Job",
    "pytorchjobs": "PyTorchJob",
    "tfjobs": "TFJob",
    "mpijobs": "MPIJob",
    "jobsets": "JobSet",
}


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

    @property
    def group(self) -> str:
        return self.res[0].rsplit("/", 1)[0] if "/" in self.res[0] else ""


@dataclass
class Watcher:
    res: ResKey
    namespace: str | None
    selector: list[tuple[str, str, str]]
    bookmarks: bool
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


def parse_path(path: str) -> Route | None:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        gv, rest = parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
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


class FakeApiServer:
    """See the module docstring: a stand-in for tests, never a real API server."""

    def __init__(self, bookmark_interval: float | None = None, gone_as_http: bool = False):
        self.bookmark_interval = bookmark_interval
        self.gone_as_http = gone_as_http
        self.rv = 1
        self.compacted_rv = 0
        self.store: dict[ResKey, dict[tuple[str, str], Obj]] = {}
        self.log: list[tuple[int, ResKey, str, Obj]] = []
        self.watchers: list[Watcher] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.deletes: list[tuple[str, str]] = []  # (path, propagationPolicy)
        self.patches: list[tuple[str, str, Obj]] = []  # (path, content type, body)
        self.missing_groups: set[str] = set()
        self.pod_logs: dict[tuple[str, str], str] = {}  # (namespace, pod) -> container output
        self._failures: list[tuple[str, str, int]] = []  # (method, path prefix, status)
        self._runner: web.AppRunner | None = None
        self._bookmark_task: asyncio.Task[None] | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        if self.bookmark_interval:
            self._bookmark_task = asyncio.create_task(self._bookmark_loop())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        if self._bookmark_task is not None:
            self._bookmark_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._bookmark_task
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
        history: a change made while a client was away, whose history was then compacted."""
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
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        obj.setdefault("kind", KINDS.get(route.res[1], "Object"))
        obj.setdefault("apiVersion", route.res[0])
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        bucket[key] = obj
        if not silent:
            self._notify(route.res, "MODIFIED" if old is not None else "ADDED", obj)
        return obj

    def get(self, path: str) -> Obj | None:
        route = parse_path(path)
        assert route is not None and route.name is not None, path
        ns = route.namespace or ""
        return self.store.get(route.res, {}).get((ns, route.name))

    def remove(self, path: str, silent: bool = False) -> Obj | None:
        """Delete the object at an item path and notify watchers (see `put` for silent)."""
        route = parse_path(path)
        assert route is not None and route.name is not None, path
        if silent:
            return self.store.get(route.res, {}).pop((route.namespace or "", route.name), None)
        return self._delete(route, "Background")

    def items(self, gv: str, plural: str) -> list[Obj]:
        return list(self.store.get((gv, plural), {}).values())

    def compact(self) -> None:
        """Forget history: any watch from an older resourceVersion now gets 410 Gone."""
        self.compacted_rv = self.rv
        self.log.clear()

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

    def send_raw(self, line: bytes, plural: str | None = None) -> None:
        for w in self.watchers:
            if plural is None or w.res[1] == plural:
                w.queue.put_nowait(line)

    def bookmark(self) -> None:
        for w in self.watchers:
            if w.bookmarks:
                w.queue.put_nowait(self._bookmark_line(w.res))

    def fail_next(self, method: str, path_prefix: str, status_code: int = 500) -> None:
        self._failures.append((method, path_prefix, status_code))

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

    def _notify(self, res: ResKey, kind: str, obj: Obj) -> None:
        snap = copy.deepcopy(obj)
        self.log.append((self.rv, res, kind, snap))
        line = self._line({"type": kind, "object": snap})
        ns = snap["metadata"].get("namespace")
        for w in self.watchers:
            if w.res != res or (w.namespace is not None and w.namespace != ns):
                continue
            if matches(snap, w.selector):
                w.queue.put_nowait(line)

    def _delete(self, route: Route, policy: str) -> Obj | None:
        ns = route.namespace or ""
        bucket = self.store.get(route.res, {})
        obj = bucket.pop((ns, route.name or ""), None)
        if obj is None:
            return None
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._notify(route.res, "DELETED", obj)
        if policy != "Orphan":
            uid = obj["metadata"].get("uid")
            for res, objs in list(self.store.items()):
                for (ons, oname), o in list(objs.items()):
                    owners = o.get("metadata", {}).get("ownerReferences") or []
                    if any(ref.get("uid") == uid for ref in owners):
                        self._delete(Route(res, ons or None, oname), policy)
        return obj

    def _take_failure(self, method: str, path: str) -> int | None:
        for i, (m, prefix, code) in enumerate(self._failures):
            if m == method and path.startswith(prefix):
                del self._failures[i]
                return code
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        query = dict(request.query)
        self.requests.append((request.method, path, query))
        code = self._take_failure(request.method, path)
        if code is not None:
            return web.json_response(status(code, "InternalError", "injected"), status=code)
        if request.method == "GET" and path.endswith("/log") and "/pods/" in path:
            return self._pod_log(path, query)
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
                    return web.json_response(status(404, "NotFound", "not found"), status=404)
                return web.json_response(obj)
            if query.get("watch") in ("1", "true"):
                return await self._watch(request, route, query)
            return self._list(route, query)
        if request.method == "POST" and route.name is None:
            body = await request.json()
            name = (body.get("metadata") or {}).get("name")
            if not name:
                return web.json_response(status(422, "Invalid", "name required"), status=422)
            if (route.namespace or "", name) in self.store.get(route.res, {}):
                msg = f"{route.res[1]} {name!r} already exists"
                return web.json_response(status(409, "AlreadyExists", msg), status=409)
            obj = self.put(path, body)
            return web.json_response(obj, status=201)
        if request.method == "PATCH" and route.name is not None:
            ctype = request.headers.get("Content-Type", "")
            if "merge-patch" not in ctype:
                return web.json_response(status(415, "UnsupportedMediaType", ctype), status=415)
            body = await request.json()
            self.patches.append((path, ctype, body))
            collection = path.rsplit("/", 1)[0]
            old = self.store.get(route.res, {}).get((route.namespace or "", route.name))
            if old is None:
                return web.json_response(status(404, "NotFound", "not found"), status=404)
            return web.json_response(self.put(collection, merge_patch(old, body)))
        if request.method == "DELETE" and route.name is not None:
            policy = query.get("propagationPolicy", "")
            self.deletes.append((path, policy))
            obj = self._delete(route, policy)
            if obj is None:
                return web.json_response(status(404, "NotFound", "not found"), status=404)
            return web.json_response(obj)
        return web.json_response(status(405, "MethodNotAllowed", request.method), status=405)

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

    def _selected(self, route: Route, query: dict[str, str]) -> list[Obj]:
        reqs = parse_selector(query.get("labelSelector", ""))
        out = []
        for (ns, _), obj in sorted(self.store.get(route.res, {}).items()):
            if route.namespace is not None and ns != route.namespace:
                continue
            if matches(obj, reqs):
                out.append(obj)
        return out

    def _list(self, route: Route, query: dict[str, str]) -> web.Response:
        items = self._selected(route, query)
        limit = int(query.get("limit", "0") or 0)
        start = 0
        token = query.get("continue", "")
        if token:
            offset, at_rv = (int(x) for x in token.split(":"))
            if at_rv < self.compacted_rv:
                return web.json_response(status(410, "Expired", "continue expired"), status=410)
            start = offset
        page = items[start : start + limit] if limit else items[start:]
        meta: Obj = {"resourceVersion": str(self.rv)}
        if limit and start + limit < len(items):
            meta["continue"] = f"{start + limit}:{self.rv}"
        kind = KINDS.get(route.res[1], "Object") + "List"
        return web.json_response(
            {"kind": kind, "apiVersion": route.res[0], "metadata": meta, "items": page}
        )

    async def _watch(
        self, request: web.Request, route: Route, query: dict[str, str]
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
        )
        # Replay: from the log after `since`, or (no version) the current state as ADDED.
        if since:
            for rv, res, kind, obj in self.log:
                if rv > since and res == route.res and matches(obj, w.selector):
                    ns = obj["metadata"].get("namespace")
                    if route.namespace is None or ns == route.namespace:
                        await resp.write(self._line({"type": kind, "object": obj}))
        else:
            for obj in self._selected(route, query):
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
                await resp.write(line)
        except ConnectionResetError:
            return resp
        finally:
            self.watchers.remove(w)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp
