"""The thin REST layer over kubernetes-asyncio, and the list+watch loop (a "reflector").

Why not the generated `CoreV1Api` + `watch.Watch`: both build V1 models (json.loads then
model objects, ~400 µs a pod). We call `ApiClient.call_api(..., _preload_content=False)`,
which keeps kubernetes-asyncio's auth (bearer tokens, exec plugins, client certs, TLS) and
returns the raw aiohttp response; bodies and watch lines are decoded with msgspec into the
small Structs of `agents.kube.decode`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import aiohttp
import structlog
from kubernetes_asyncio.client import ApiClient

from agents.kube.decode import (
    Decoded,
    KStatus,
    T,
    decode_list_lenient,
    decode_status,
    decode_watch_line,
)

log = structlog.get_logger("muster.agent.kube")

Item = TypeVar("Item")
MAX_LINE = 16 * 2**20  # one watch event; etcd's request limit is 1.5 MiB, CRDs can be large
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"  # RFC 6902: a list of operations


class KubeApiError(RuntimeError):
    """A non-2xx answer from the API server, with its metav1.Status (and Retry-After, s)."""

    def __init__(
        self,
        method: str,
        path: str,
        status: int,
        detail: KStatus,
        retry_after: float | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.detail = detail
        self.retry_after = retry_after
        text = detail.message or detail.reason or "no message"
        super().__init__(f"{method} {path}: HTTP {status}: {text}")


def retry_after_s(resp: aiohttp.ClientResponse) -> float | None:
    """The Retry-After header in seconds (the API server sends whole seconds), capped."""
    raw = resp.headers.get("Retry-After", "")
    try:
        return min(max(float(raw), 0.0), 60.0) if raw else None
    except ValueError:
        return None


Refresh = Callable[[], Awaitable[bool]]
MAX_THROTTLED = 10  # 429 retries of one request, each after its Retry-After (client-go's)


class GoneError(KubeApiError):
    """410 Gone: the resourceVersion (or continue token) is too old; re-list."""


class RateLimit:
    """A token bucket (client-go's `--kube-api-qps` / `--kube-api-burst`) plus a bound on
    requests in flight, shared by every non-watch request of one agent.

    A burst (a checkpoint request to every pod of a 1,000-pod gang) goes out at once up to
    `burst`, then at `qps`; a 429 from the API server's priority and fairness holds every
    request until its Retry-After has passed, so the agent backs off as a whole instead of
    each request retrying on its own."""

    def __init__(self, qps: float = 50.0, burst: int = 1000, inflight: int = 32) -> None:
        self.qps = qps
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.not_before = 0.0  # monotonic: a 429's Retry-After holds everything until then
        self.slots = asyncio.Semaphore(inflight)
        self.waited = 0  # requests that waited for a token

    async def acquire(self) -> None:
        while True:
            now = time.monotonic()
            if now < self.not_before:
                await asyncio.sleep(self.not_before - now)
                continue
            self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.qps)
            self.stamp = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return
            self.waited += 1
            await asyncio.sleep((1.0 - self.tokens) / self.qps)

    def hold(self, seconds: float) -> None:
        """A 429 said to come back after `seconds`: no request before then."""
        self.not_before = max(self.not_before, time.monotonic() + seconds)


class KubeRest:
    """JSON requests through an ApiClient's REST layer, returning raw bytes.

    `refresh` renews the credentials (an exec plugin or OIDC token): on a 401 it is called
    once and the request retried, so an expired token costs one round trip, not a watch."""

    def __init__(
        self,
        api: ApiClient,
        timeout_s: float = 30.0,
        refresh: Refresh | None = None,
        limit: RateLimit | None = None,
    ) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.refresh = refresh
        self.limit = limit or RateLimit()
        self.sent = 0  # non-watch requests sent (the API-call budget's figure)
        self.refreshes = 0  # credential refreshes after a 401
        self.throttled = 0  # 429 answers honoured
        self.skipped = 0  # list items that did not decode

    @property
    def url(self) -> str:
        host: str | None = self.api.configuration.host
        return host or ""

    async def open(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | list[Any] | None = None,
        content_type: str = "application/json",
        timeout: aiohttp.ClientTimeout | float | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a request; the caller reads (and releases) the raw response. A 401 refreshes
        the credentials and retries once."""
        for attempt in range(2):
            resp: aiohttp.ClientResponse = await self.api.call_api(
                path,
                method,
                query_params=list(query or []),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout if timeout is not None else self.timeout_s,
            )
            if resp.status != 401 or attempt or self.refresh is None:
                return resp
            resp.release()
            if not await self.refresh():
                break
            self.refreshes += 1
        return resp

    async def request(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | list[Any] | None = None,
        content_type: str = "application/json",
        ok_missing: bool = False,
    ) -> bytes | None:
        """The response body; None for a 404 when `ok_missing`; KubeApiError otherwise. A 429
        is retried after its Retry-After (a few times) as client-go does."""
        for throttled in range(MAX_THROTTLED + 1):
            await self.limit.acquire()
            async with self.limit.slots:
                self.sent += 1
                resp = await self.open(method, path, query, body, content_type)
                try:
                    data = await resp.read()
                    status = resp.status
                    wait = retry_after_s(resp)
                finally:
                    resp.release()
            if 200 <= status < 300:
                return data
            if status == 404 and ok_missing:
                return None
            if status == 429:
                self.limit.hold(wait if wait is not None else 1.0)
                if throttled < MAX_THROTTLED:
                    self.throttled += 1
                    continue
            break
        err = GoneError if status == 410 else KubeApiError
        raise err(method, path, status, decode_status(data), wait)

    async def create(self, collection: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """POST; the object as created, or None when it already exists (409), which makes a
        retried dispatch safe."""
        try:
            data = await self.request("POST", collection, body=body)
        except KubeApiError as exc:
            if exc.status == 409:
                return None
            raise
        out = json.loads(data or b"{}")
        return out if isinstance(out, dict) else {}

    async def metadata_of(self, collection: str, name: str) -> dict[str, Any] | None:
        """The metadata of an existing object (None when it is gone). A list by name, since
        the agent's RBAC grants `list`, not `get`, on what it creates."""
        q = [("fieldSelector", f"metadata.name={name}")]
        out = json.loads(await self.request("GET", collection, query=q) or b"{}")
        items = out.get("items") if isinstance(out, dict) else None
        first = items[0] if isinstance(items, list) and items else None
        meta = first.get("metadata") if isinstance(first, dict) else None
        return meta if isinstance(meta, dict) else None

    async def object_of(self, collection: str, name: str) -> dict[str, Any] | None:
        """An existing object whole (None when it is gone), listed by name as `metadata_of`."""
        q = [("fieldSelector", f"metadata.name={name}")]
        out = json.loads(await self.request("GET", collection, query=q) or b"{}")
        items = out.get("items") if isinstance(out, dict) else None
        first = items[0] if isinstance(items, list) and items else None
        return first if isinstance(first, dict) else None

    async def delete(self, item: str, propagation: str) -> bool:
        """DELETE with a propagation policy (batch/v1 Jobs orphan their pods by default);
        False when it did not exist."""
        q = [("propagationPolicy", propagation)]
        return await self.request("DELETE", item, query=q, ok_missing=True) is not None

    async def merge_patch(self, item: str, patch: dict[str, Any] | list[Any]) -> bool:
        """A JSON merge patch (a mapping) or a JSON patch (a list of operations); False when
        the object is gone. Custom resources take no strategic merge patch."""
        kind = JSON_PATCH if isinstance(patch, list) else MERGE_PATCH
        return (
            await self.request("PATCH", item, body=patch, content_type=kind, ok_missing=True)
            is not None
        )

    async def list_pages(
        self,
        collection: str,
        kind: type[T],
        label_selector: str = "",
        page_size: int = 500,
        max_pages: int = 10_000,
        *,
        field_selector: str = "",
    ) -> AsyncIterator[tuple[list[T], str]]:
        """A consistent, paginated list, one decoded page at a time: (items, the list's
        resourceVersion). Never `resourceVersion=0`, which the watch cache answers with one
        body of the whole collection whatever the `limit` (hundreds of MiB on a big cluster).
        Only one page's bytes are held at once. An expired continue token (the list outlived
        the server's compaction window) raises GoneError; the caller starts over."""
        token = ""
        for _ in range(max_pages):
            q = [("limit", str(page_size))]
            if label_selector:
                q.append(("labelSelector", label_selector))
            if field_selector:
                q.append(("fieldSelector", field_selector))
            if token:
                q.append(("continue", token))
            data = await self.request("GET", collection, query=q)
            page, skipped = decode_list_lenient(data or b"{}", kind)
            del data
            self.skipped += skipped
            token = page.metadata.continue_
            yield page.items or [], page.metadata.resourceVersion
            if not token:
                return
        raise KubeApiError("GET", collection, 0, KStatus(message="too many pages"))

    async def list_all(
        self,
        collection: str,
        kind: type[T],
        label_selector: str = "",
        page_size: int = 500,
        max_pages: int = 10_000,
        *,
        field_selector: str = "",
    ) -> tuple[list[T], str]:
        """Every item of a (small) collection and the list's resourceVersion."""
        items: list[T] = []
        rv = ""
        async for page, page_rv in self.list_pages(
            collection, kind, label_selector, page_size, max_pages, field_selector=field_selector
        ):
            items.extend(page)
            rv = page_rv or rv
        return items, rv


def item_path(collection: str, name: str) -> str:
    return f"{collection}/{quote(name, safe='')}"


class BadInput:
    """Malformed or unexpected objects from the API server, counted per (kind, reason) and
    logged once per (kind, reason): one bad object in a list of 10,000 must not flood logs."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def note(self, kind: str, reason: str, **detail: Any) -> None:
        self.counts[(kind, reason)] += 1
        if self.counts[(kind, reason)] == 1:
            log.warning("bad input from the API server ignored", kind=kind, reason=reason, **detail)

    def total(self) -> int:
        return sum(self.counts.values())


class Outage:
    """Whether the API server answers, shared by every reflector of one backend: one log line
    (with the URL) when it stops answering, one when it answers again."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.since: float | None = None

    def failed(self, exc: BaseException, retry_s: float) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.warning(
                "Kubernetes API server unreachable; retrying with backoff",
                url=self.url,
                error=f"{type(exc).__name__}: {exc}"[:300],
                retry_max_s=retry_s,
            )

    def ok(self) -> None:
        if self.since is not None:
            log.info(
                "Kubernetes API server reachable again",
                url=self.url,
                after_s=round(time.monotonic() - self.since, 1),
            )
            self.since = None


def unreachable(exc: BaseException) -> bool:
    """No answer at all (refused, reset, DNS, TLS, timeout), as opposed to an HTTP error."""
    return isinstance(exc, (OSError, TimeoutError, aiohttp.ClientConnectorError))


def object_key(obj: Any) -> str:
    meta = obj.metadata
    return meta.uid or f"{meta.namespace}/{meta.name}"


class Reflector(Generic[T]):
    """List, then watch from the list's resourceVersion with bookmarks, forever (client-go's
    reflector and store).

    * a watch that ends (server timeout, connection reset, 5xx, 429, 401 after a refresh)
      resumes from the last resourceVersion seen; events and BOOKMARKs advance it. Failures
      back off exponentially with jitter (a 429 waits its Retry-After);
    * only 410 Gone (HTTP status or ERROR event) re-lists, with a consistent read;
    * lists are paginated consistent reads (`limit` + `continue`), decoded a page at a time;
    * every `resync_s` the local cache is replayed to `on_replace` (no request), so handlers
      can re-evaluate timers and repair drift, as client-go's resync does;
    * with `absent_retry_s` set, the collection is optional (a CRD that may not be installed):
      a 404 (or 403, not granted) is logged once, `absent` holds the status, and the list is
      retried every `absent_retry_s` instead of backing off as for a failure;
    * `failing_since` (monotonic) is set while list/watch requests fail: the backend reports
      itself stale when that lasts.
    `on_replace(items)` (a coroutine: a list of 150,000 pods must yield to the loop while it is
    applied, see `Pacer`) receives each list; `on_event(type, obj)` each ADDED/MODIFIED/DELETED.

    Streamed instead (`on_page` and `on_listed` given, `on_replace` None): no local cache at
    all. Each page goes to `on_page` as it is decoded, then `on_listed(keys, complete)` gets
    the keys the list held (`complete` False when some item did not decode: nothing may be
    taken as gone). Memory is one page plus the keys, whatever the cluster's size; the handler
    keeps what it needs (the backend keeps a few integers per pod). Resync replays nothing.
    """

    def __init__(
        self,
        rest: KubeRest,
        collection: str,
        kind: type[T],
        on_replace: Callable[[list[T]], Awaitable[None]] | None,
        on_event: Callable[[str, T], None],
        *,
        on_page: Callable[[list[T]], Awaitable[None]] | None = None,
        on_listed: Callable[[set[str], bool], Awaitable[None]] | None = None,
        label_selector: str = "",
        field_selector: str = "",
        page_size: int = 500,
        watch_timeout_s: int = 290,
        resync_s: float = 300.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 30.0,
        absent_retry_s: float | None = None,
        name: str = "",
        outage: Outage | None = None,
        bad_input: BadInput | None = None,
    ) -> None:
        self.rest = rest
        self.collection = collection
        self.kind: type[T] = kind
        self.on_replace: Callable[[list[T]], Awaitable[None]] | None = on_replace
        self.on_page: Callable[[list[T]], Awaitable[None]] | None = on_page
        self.on_listed: Callable[[set[str], bool], Awaitable[None]] | None = on_listed
        if (on_replace is None) == (on_page is None or on_listed is None):
            raise ValueError("give on_replace, or on_page and on_listed")
        self.on_event: Callable[[str, T], None] = on_event
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.page_size = page_size
        self.watch_timeout_s = watch_timeout_s
        self.resync_s = resync_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.absent_retry_s = absent_retry_s
        self.name = name or collection
        self.outage = outage or Outage(rest.url)
        self.bad_input = bad_input or BadInput()
        self.absent = 0  # 404/403 while an optional collection is not served, else 0
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.cache: dict[str, T] = {}
        self.failing_since: float | None = None
        # Counters, for tests and metrics.
        self.lists = 0
        self.resyncs = 0
        self.gone = 0
        self.bookmarks = 0
        self.events = 0
        self.bad_lines = 0
        self.errors = 0
        self.resumes = 0  # watches resumed from their resourceVersion after a failure
        self._resynced_at = 0.0

    async def list_once(self) -> None:
        """One full list, page by page (retrying once when the continue token expires
        mid-list). Cached: the old objects are released as their new versions arrive, so a
        re-list never holds two copies of the collection."""
        skipped_before = self.rest.skipped
        for attempt in range(2):
            old, fresh, keys = self.cache, dict[str, T](), set[str]()
            rv = ""
            try:
                async for page, page_rv in self.rest.list_pages(
                    self.collection,
                    self.kind,
                    self.label_selector,
                    self.page_size,
                    field_selector=self.field_selector,
                ):
                    if self.on_page is not None:
                        keys.update(object_key(o) for o in page)
                        await asyncio.sleep(0)  # the page's decoding was one loop step
                        await self.on_page(page)
                    else:
                        for o in page:
                            key = object_key(o)
                            old.pop(key, None)
                            fresh[key] = o
                    rv = page_rv or rv
            except BaseException as exc:
                old.update(fresh)  # what arrived is newer; what did not stays as it was
                if not isinstance(exc, GoneError) or attempt:
                    raise
                self.gone += 1
                log.info("list outlived its continue token (410); again", collection=self.name)
                continue
            if self.absent:
                log.info("collection is served now; watching it", collection=self.name)
                self.absent = 0
            complete = self.rest.skipped == skipped_before
            if not complete:
                # Some items did not decode: what they were before stays, so a malformed
                # object never reads as a deleted one (which could end an attempt).
                self.bad_input.note(self.name, "undecodable list item")
                fresh.update(old)
            if self.on_listed is not None:
                await self.on_listed(keys, complete)
            else:
                self.cache = fresh
                assert self.on_replace is not None
                await self.on_replace(list(fresh.values()))
            self.resource_version = rv
            self.lists += 1
            self._resynced_at = time.monotonic()
            self._ok()
            self.synced.set()
            return

    async def resync(self) -> None:
        """Replay the local cache to the handler: no request to the API server (a streamed
        reflector has no cache: its handler's state is already current)."""
        self.resyncs += 1
        self._resynced_at = time.monotonic()
        if self.on_replace is not None:
            await self.on_replace(list(self.cache.values()))

    def _ok(self) -> None:
        self.failing_since = None
        self.outage.ok()

    def stale_for(self, now: float | None = None) -> float:
        """Seconds the list/watch requests have been failing (0 when they work)."""
        if self.failing_since is None or self.absent:
            return 0.0
        return (time.monotonic() if now is None else now) - self.failing_since

    async def run(self) -> None:
        """The loop; ends only when cancelled."""
        backoff = self.backoff_initial_s
        need_list = not self.synced.is_set()
        while True:
            if self.absent and self.absent_retry_s is not None:
                await asyncio.sleep(self.absent_retry_s)
            try:
                if need_list:
                    await self.list_once()
                    need_list = False
                elif time.monotonic() - self._resynced_at >= self.resync_s:
                    await self.resync()
                await self._watch_once()
                backoff = self.backoff_initial_s
            except GoneError:
                self.gone += 1
                need_list = True
                log.info("watch expired (410); re-listing", collection=self.name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # network, 5xx, 429, 401, a list body that is no list
                if self.note_absent(exc):
                    need_list = True
                    continue
                if not self.resource_version:
                    need_list = True  # nothing to resume from
                self.errors += 1
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                delay = min(self.backoff_max_s, backoff) * (0.5 + random.random() / 2)
                if isinstance(exc, KubeApiError) and exc.retry_after is not None:
                    delay = exc.retry_after
                if unreachable(exc):
                    self.outage.failed(exc, self.backoff_max_s)
                else:
                    if self.errors == 1 or (self.errors & (self.errors - 1)) == 0:
                        log.warning(
                            "list/watch failed; resuming from the last resourceVersion",
                            collection=self.name,
                            url=self.rest.url,
                            error=str(exc)[:300],
                            delay_s=round(delay, 2),
                        )
                await asyncio.sleep(delay)
                backoff = min(self.backoff_max_s, backoff * 2)
                if not need_list:
                    self.resumes += 1

    def note_absent(self, exc: BaseException) -> bool:
        """True when `exc` means an optional collection is not served (404) or not granted
        (403); logged once per change, then retried quietly every `absent_retry_s`."""
        if (
            self.absent_retry_s is None
            or not isinstance(exc, KubeApiError)
            or exc.status not in (403, 404)
        ):
            return False
        if self.absent != exc.status:
            self.absent = exc.status
            retry = {"collection": self.name, "retry_s": self.absent_retry_s}
            if exc.status == 404:
                log.info("collection not served (CRD not installed?); skipping it", **retry)
            else:
                log.warning("no permission to list/watch; skipping it (check RBAC)", **retry)
        return True

    async def _watch_once(self) -> None:
        """One watch request until the server closes it; raises GoneError on 410."""
        remaining = self.resync_s - (time.monotonic() - self._resynced_at)
        server_timeout = max(1, min(self.watch_timeout_s, int(remaining) + 1))
        q = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(server_timeout)),
        ]
        if self.resource_version:
            q.append(("resourceVersion", self.resource_version))
        if self.label_selector:
            q.append(("labelSelector", self.label_selector))
        if self.field_selector:
            q.append(("fieldSelector", self.field_selector))
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.rest.timeout_s, sock_read=server_timeout + 30
        )
        resp = await self.rest.open("GET", self.collection, q, timeout=timeout)
        try:
            if resp.status != 200:
                data = await resp.read()
                err = GoneError if resp.status == 410 else KubeApiError
                raise err(
                    "GET", self.collection, resp.status, decode_status(data), retry_after_s(resp)
                )
            self._ok()
            while True:
                try:
                    line = await resp.content.readline(max_line_length=MAX_LINE)
                except TimeoutError:
                    return  # idle past the read timeout: resume from the last version
                if not line:
                    return
                self._handle(line)
        finally:
            resp.release()

    def _handle(self, line: bytes) -> None:
        ev: Decoded[T] | None = decode_watch_line(line, self.kind)
        if ev is None:
            if line.strip():
                self.bad_lines += 1
                self.bad_input.note(self.name, "undecodable watch line", line=line[:200])
            return
        if ev.type == "ERROR":
            err = ev.error or KStatus()
            if err.code == 410:
                raise GoneError("WATCH", self.collection, 410, err)
            raise KubeApiError("WATCH", self.collection, err.code, err)
        rv = ev.resource_version
        if ev.type == "BOOKMARK":
            self.bookmarks += 1
        elif ev.obj is not None and ev.type in ("ADDED", "MODIFIED", "DELETED"):
            self.events += 1
            key = object_key(ev.obj)
            if self.on_replace is None:
                pass  # streamed: the handler keeps its own state
            elif ev.type == "DELETED":
                self.cache.pop(key, None)
            else:
                self.cache[key] = ev.obj
            try:
                self.on_event(ev.type, ev.obj)
            except Exception as exc:  # a handler bug must not kill the watch
                self.bad_input.note(self.name, f"handler failed: {type(exc).__name__}")
                log.exception("watch handler failed", collection=self.name, error=str(exc))
        else:
            self.bad_lines += 1
            self.bad_input.note(self.name, f"unexpected watch event {ev.type!r}")
            return
        if rv:
            self.resource_version = rv


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Wait `seconds` or until `stop`; True when stopped."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


Task = Callable[[], Awaitable[None]]


class Pacer:
    """Yields to the event loop once `slice_s` of work has passed, so a long loop over a
    cluster's pods (a list, a resync) never holds the loop (heartbeats, acks, /livez) for
    longer than a slice. Cheap enough to call per item."""

    def __init__(self, slice_s: float = 0.005) -> None:
        self.slice_s = slice_s
        self.since = time.perf_counter()
        self.yields = 0

    async def tick(self) -> None:
        if time.perf_counter() - self.since >= self.slice_s:
            await asyncio.sleep(0)
            self.yields += 1
            self.since = time.perf_counter()

    async def each(self, items: Iterable[Item]) -> AsyncIterator[Item]:
        for item in items:
            yield item
            await self.tick()
