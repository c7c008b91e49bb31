"""The web dashboard (`muster broker --ui-port N`): read-only pages over the broker's state.

Served by aiohttp on the broker's event loop. Handlers only read the machine's views between
awaits, so they never see it half-changed and never change it. Requests are small, bounded and
rate-limited per client address; live updates come from the EventHub over SSE.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, Protocol

import msgspec
import structlog
from aiohttp import web
from nats.aio.client import Client

from broker.core.machine import Machine
from broker.ui import views
from broker.ui.live import CLOSING, OVERFLOW, EventHub
from schemas.subjects import Subjects

log = structlog.get_logger("muster.ui")

RATE_PER_S = 20.0  # sustained requests per second per client address
RATE_BURST = 60.0
SSE_KEEPALIVE_S = 15.0
SSE_WRITE_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 4096
LOG_READS = 4  # log reads in flight at once
LOG_READ_S = 3.0
STATIC = {
    "index.html": "text/html",
    "app.js": "application/javascript",
    "style.css": "text/css",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Broker(Protocol):
    """What the dashboard reads of the broker (`broker.service.Broker`): its machine while it
    leads (None while it stands by), its clock and its NATS connection."""

    nc: Client
    subjects: Subjects
    machine: Machine | None
    clock: Callable[[], float]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class RateLimit:
    """A token bucket per client address; the table is bounded."""

    def __init__(self, rate: float = RATE_PER_S, burst: float = RATE_BURST) -> None:
        self.rate = rate
        self.burst = burst
        self.buckets: dict[str, tuple[float, float]] = {}

    def allow(self, key: str, now: float) -> bool:
        tokens, last = self.buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return False
        if len(self.buckets) >= 10_000 and key not in self.buckets:
            self.buckets.clear()
        self.buckets[key] = (tokens - 1.0, now)
        return True


class Dashboard:
    def __init__(self, broker: Broker, *, rate: RateLimit | None = None) -> None:
        self.broker = broker
        self.hub = EventHub(broker.nc, broker.subjects)
        self.rate = rate or RateLimit()
        self._log_reads = asyncio.Semaphore(LOG_READS)
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._guard])
        self.app.add_routes(
            [
                web.get("/", self._index),
                web.get("/static/{name}", self._static),
                web.get("/api/fleet", self._fleet),
                web.get("/api/queues", self._queues),
                web.get("/api/jobs", self._jobs),
                web.get("/api/jobs/{job_id}", self._job),
                web.get("/api/jobs/{job_id}/logs", self._logs),
                web.get("/api/interruptions", self._interruptions),
                web.get("/api/events", self._events),
            ]
        )

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        await self.hub.start()
        self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        bound = self.runner.addresses[0][1] if self.runner.addresses else port
        self.url = f"http://{host}:{bound}"
        log.info("ui.serving", url=self.url)
        return self.url

    async def stop(self) -> None:
        await self.hub.stop()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ------------------------------------------------------------------ plumbing
    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "GET":
            return _error(405, "the dashboard is read-only: only GET is served")
        if len(request.query_string) > 1024:
            return _error(414, "query string over 1024 bytes; narrow the filter")
        if not self.rate.allow(request.remote or "?", time.monotonic()):
            return _error(429, f"over {RATE_PER_S:.0f} requests/s; slow down and retry")
        try:
            return await handler(request)
        except views.BadRequest as exc:
            return _error(400, str(exc))

    def _machine(self) -> Machine:
        machine = self.broker.machine
        if machine is None:
            raise web.HTTPServiceUnavailable(
                text='{"error": "this broker is standing by; open the leader\'s dashboard"}',
                content_type="application/json",
            )
        return machine

    # ------------------------------------------------------------------ pages
    async def _index(self, request: web.Request) -> web.StreamResponse:
        views.check_params(request.query, frozenset())
        return self._file("index.html")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            return _error(404, f"no static file {name[:40]!r}")
        return self._file(name)

    @staticmethod
    def _file(name: str) -> web.Response:
        data = resources.files("broker.ui").joinpath("static", name).read_bytes()
        return web.Response(
            body=data,
            content_type=STATIC[name],
            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
        )

    async def _fleet(self, request: web.Request) -> web.StreamResponse:
        views.check_params(request.query, frozenset())
        return _json(views.fleet(self._machine(), self.broker.clock()))

    async def _queues(self, request: web.Request) -> web.StreamResponse:
        views.check_params(request.query, frozenset())
        return _json(views.queues(self._machine(), self.broker.clock()))

    async def _jobs(self, request: web.Request) -> web.StreamResponse:
        return _json(views.jobs_page(self._machine(), request.query, self.broker.clock()))

    async def _job(self, request: web.Request) -> web.StreamResponse:
        views.check_params(request.query, frozenset())
        job_id = views.job_id_param(request.match_info["job_id"])
        detail = views.job_detail(self._machine(), job_id, self.broker.clock())
        if detail is None:
            return _error(404, f"unknown job {job_id!r}")
        return _json(detail)

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        """The last lines of an attempt, asked of the agent of its cluster (never the broker's
        own work); at most LOG_READS at once, each bounded by LOG_READ_S."""
        from broker.client import MusterError
        from broker.logs import stream_chunks, where_it_ran
        from schemas.agent import LogRequest

        views.check_params(request.query, frozenset({"attempt", "tail"}))
        job_id = views.job_id_param(request.match_info["job_id"])
        attempt = views.int_param(request.query, "attempt", 0, 0, 100_000) or None
        tail = views.int_param(request.query, "tail", 20, 1, views.PAGE_MAX)
        view = self._machine().views.job_view(job_id, self.broker.clock(), with_spec=False)
        if view is None:
            return _error(404, f"unknown job {job_id!r}")
        if self._log_reads.locked():
            return _error(503, "log reads are busy; retry in a moment")
        lines: list[str] = []
        try:
            number, cluster = where_it_ran(view, attempt)
            req = LogRequest(job_id=job_id, attempt=number, tail_lines=tail, limit_bytes=64_000)
            async with self._log_reads, asyncio.timeout(LOG_READ_S):
                async for chunk in stream_chunks(
                    self.broker.nc, self.broker.subjects, cluster, req, first_s=LOG_READ_S
                ):
                    lines.extend(chunk)
        except MusterError as exc:
            return _json({"lines": [], "error": str(exc)})
        except TimeoutError:
            return _json({"lines": lines, "error": f"no complete answer in {LOG_READ_S:g}s"})
        return _json({"attempt": number, "cluster": cluster, "lines": lines})

    async def _interruptions(self, request: web.Request) -> web.StreamResponse:
        views.check_params(request.query, frozenset({"limit"}))
        limit = views.int_param(request.query, "limit", 50, 1, views.PAGE_MAX)
        now = self.broker.clock()
        machine = self.broker.machine
        return _json(
            {
                "now": now,
                "items": self.hub.interruptions.newest_first(limit),
                "total": self.hub.interruptions.total,
                "fleet_notices": views.fleet_notices(machine, now) if machine else None,
            }
        )

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: each job event as `data:`; `event: overflow` when skipped."""
        views.check_params(request.query, frozenset({"job"}))
        job = request.query.get("job") or None
        if job is not None:
            views.job_id_param(job)
        client = self.hub.join(job)
        if client is None:
            return _error(503, "too many live clients; close another dashboard tab")
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        try:
            await resp.prepare(request)
            await resp.write(b"event: hello\ndata: {}\n\n")
            while True:
                try:
                    async with asyncio.timeout(SSE_KEEPALIVE_S):
                        data = await client.queue.get()
                except TimeoutError:
                    data = b""
                if data is CLOSING:
                    break
                if not data:
                    chunk = b": keepalive\n\n"
                elif data is OVERFLOW:
                    chunk = b"event: overflow\ndata: {}\n\n"
                else:
                    chunk = b"data: " + data + b"\n\n"
                async with asyncio.timeout(SSE_WRITE_TIMEOUT_S):  # a stuck reader is dropped
                    await resp.write(chunk)
        except (ConnectionResetError, TimeoutError):
            pass  # the client left, or read too slowly to be worth waiting for
        finally:
            self.hub.leave(client)
        return resp


async def start_dashboard(broker: Broker, host: str, port: int) -> Dashboard:
    dashboard = Dashboard(broker)
    await dashboard.start(host, port)
    return dashboard
