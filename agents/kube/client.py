"""The thin REST layer over kubernetes-asyncio, and the list+watch loop (a "reflector").

Why not the generated `CoreV1Api` + `watch.Watch`: both build V1 models (json.loads then
model objects, ~400 µs a pod). We call `ApiClient.call_api(..., _preload_content=False)`,
which keeps kubernetes-asyncio's auth (bearer tokens, exec plugins, client certs, TLS) and
returns the raw aiohttp response; bodies and watch lines are decoded with msgspec into the
small Structs of `agents.kube.decode`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic
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

MAX_LINE = 16 * 2**20  # one watch event; etcd's request limit is 1.5 MiB, CRDs can be large
MERGE_PATCH = "application/merge-patch+json"


class KubeApiError(RuntimeError):
    """A non-2xx answer from the API server, with its metav1.Status."""

    def __init__(self, method: str, path: str, status: int, detail: KStatus) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.detail = detail
        text = detail.message or detail.reason or "no message"
        super().__init__(f"{method} {path}: HTTP {status}: {text}")


class GoneError(KubeApiError):
    """410 Gone: the resourceVersion (or continue token) is too old; re-list."""


class KubeRest:
    """JSON requests through an ApiClient's REST layer, returning raw bytes."""

    def __init__(self, api: ApiClient, timeout_s: float = 30.0) -> None:
        self.api = api
        self.timeout_s = timeout_s

    async def open(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: aiohttp.ClientTimeout | float | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a request; the caller reads (and releases) the raw response."""
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
        return resp

    async def request(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | None = None,
        content_type: str = "application/json",
        ok_missing: bool = False,
    ) -> bytes | None:
        """The response body; None for a 404 when `ok_missing`; KubeApiError otherwise."""
        resp = await self.open(method, path, query, body, content_type)
        try:
            data = await resp.read()
            status = resp.status
        finally:
            resp.release()
        if 200 <= status < 300:
            return data
        if status == 404 and ok_missing:
            return None
        err = GoneError if status == 410 else KubeApiError
        raise err(method, path, status, decode_status(data))

    async def create(self, collection: str, body: dict[str, Any]) -> bool:
        """POST; False when it already exists (409), which makes a retried dispatch safe."""
        try:
            await self.request("POST", collection, body=body)
        except KubeApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def delete(self, item: str, propagation: str) -> bool:
        """DELETE with a propagation policy (batch/v1 Jobs orphan their pods by default);
        False when it did not exist."""
        q = [("propagationPolicy", propagation)]
        return await self.request("DELETE", item, query=q, ok_missing=True) is not None

    async def merge_patch(self, item: str, patch: dict[str, Any]) -> bool:
        return (
            await self.request("PATCH", item, body=patch, content_type=MERGE_PATCH, ok_missing=True)
            is not None
        )

    async def list_all(
        self,
        collection: str,
        kind: type[T],
        label_selector: str = "",
        page_size: int = 500,
        max_pages: int = 10_000,
    ) -> tuple[list[T], str]:
        """Every item of a collection (paginated) and the list's resourceVersion. An expired
        continue token raises GoneError; the caller starts over."""
        items: list[T] = []
        token = ""
        rv = ""
        for _ in range(max_pages):
            q = [("limit", str(page_size))]
            if label_selector:
                q.append(("labelSelector", label_selector))
            if token:
                q.append(("continue", token))
            data = await self.request("GET", collection, query=q)
            page, skipped = decode_list_lenient(data or b"{}", kind)
            if skipped:
                log.warning("undecodable list items skipped", collection=collection, count=skipped)
            items.extend(page.items or [])
            rv = page.metadata.resourceVersion or rv
            token = page.metadata.continue_
            if not token:
                return items, rv
        raise KubeApiError("GET", collection, 0, KStatus(message="too many pages"))


def item_path(collection: str, name: str) -> str:
    return f"{collection}/{quote(name, safe='')}"


class Reflector(Generic[T]):
    """List, then watch from the list's resourceVersion with bookmarks, forever.

    * a watch that ends normally (server timeout) resumes from the last resourceVersion seen
      (events and BOOKMARKs advance it) without a re-list;
    * 410 Gone (HTTP status or ERROR event) or any other failure -> re-list, after a bounded
      exponential backoff with jitter for failures (not for 410);
    * every `resync_s` a full re-list repairs any drift;
    * with `absent_retry_s` set, the collection is optional (a CRD that may not be installed):
      a 404 (or 403, not granted) is logged once, `absent` holds the status, and the list is
      retried every `absent_retry_s` instead of backing off as for a failure.
    `on_replace(items)` receives each list; `on_event(type, obj)` each ADDED/MODIFIED/DELETED.
    """

    def __init__(
        self,
        rest: KubeRest,
        collection: str,
        kind: type[T],
        on_replace: Callable[[list[T]], None],
        on_event: Callable[[str, T], None],
        *,
        label_selector: str = "",
        page_size: int = 500,
        watch_timeout_s: int = 290,
        resync_s: float = 300.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 30.0,
        absent_retry_s: float | None = None,
        name: str = "",
    ) -> None:
        self.rest = rest
        self.collection = collection
        self.kind: type[T] = kind
        self.on_replace: Callable[[list[T]], None] = on_replace
        self.on_event: Callable[[str, T], None] = on_event
        self.label_selector = label_selector
        self.page_size = page_size
        self.watch_timeout_s = watch_timeout_s
        self.resync_s = resync_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.absent_retry_s = absent_retry_s
        self.name = name or collection
        self.absent = 0  # 404/403 while an optional collection is not served, else 0
        self.resource_version = ""
        self.synced = asyncio.Event()
        # Counters, for tests and metrics.
        self.lists = 0
        self.gone = 0
        self.bookmarks = 0
        self.events = 0
        self.bad_lines = 0
        self.errors = 0
        self._listed_at = 0.0

    async def list_once(self) -> None:
        """One full list (retrying once when the continue token expires mid-list)."""
        for attempt in range(2):
            try:
                items, rv = await self.rest.list_all(
                    self.collection, self.kind, self.label_selector, self.page_size
                )
            except GoneError:
                if attempt:
                    raise
                continue
            if self.absent:
                log.info("collection is served now; watching it", collection=self.name)
                self.absent = 0
            self.on_replace(items)
            self.resource_version = rv
            self.lists += 1
            self._listed_at = time.monotonic()
            self.synced.set()
            return

    async def run(self) -> None:
        """The loop; ends only when cancelled."""
        backoff = self.backoff_initial_s
        need_list = not self.synced.is_set()
        while True:
            if self.absent and self.absent_retry_s is not None:
                await asyncio.sleep(self.absent_retry_s)
            try:
                if need_list or time.monotonic() - self._listed_at >= self.resync_s:
                    await self.list_once()
                    need_list = False
                await self._watch_once()
                backoff = self.backoff_initial_s
            except GoneError:
                self.gone += 1
                need_list = True
                log.info("watch expired; re-listing", collection=self.name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # network, 5xx, decode of a list body: back off
                need_list = True
                if self.note_absent(exc):
                    continue
                self.errors += 1
                delay = min(self.backoff_max_s, backoff) * (0.5 + random.random() / 2)
                log.warning(
                    "list/watch failed; retrying",
                    collection=self.name,
                    error=str(exc)[:300],
                    delay_s=round(delay, 2),
                )
                await asyncio.sleep(delay)
                backoff = min(self.backoff_max_s, backoff * 2)

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
        remaining = self.resync_s - (time.monotonic() - self._listed_at)
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
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.rest.timeout_s, sock_read=server_timeout + 30
        )
        resp = await self.rest.open("GET", self.collection, q, timeout=timeout)
        try:
            if resp.status != 200:
                data = await resp.read()
                err = GoneError if resp.status == 410 else KubeApiError
                raise err("GET", self.collection, resp.status, decode_status(data))
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
                log.warning("undecodable watch line skipped", collection=self.name, line=line[:200])
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
            try:
                self.on_event(ev.type, ev.obj)
            except Exception as exc:  # a handler bug must not kill the watch
                log.exception("watch handler failed", collection=self.name, error=str(exc))
        else:
            self.bad_lines += 1
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
