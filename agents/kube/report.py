"""The kube agent's checkpoint report endpoint: how a step leaves a pod on the shipped deploy.

A pod cannot reach the control cluster's NATS, and writing its own annotation needs RBAC a
workload should not have. So each agent serves `POST /v1/checkpoint` (a Service in front of
it, `deploy/agent/service.yaml`); the SDK posts `{"job_id", "attempt", "step", "uri",
"token"}` there (`MUSTER_REPORT_URL`, injected into every replica). The credential is the
attempt's `MUSTER_CHECKPOINT_TOKEN`, a secret only that attempt's replicas get in their
environment: a pod needs no ServiceAccount token at all.

The backend decides (`KubeBackend.accept_report`); this module only speaks HTTP: a bounded
body, a deadline to send it, a JSON answer that says what was wrong. Refusals change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Annotated, NamedTuple

import msgspec
import structlog
from aiohttp import web
from msgspec import Meta

from agents.kube.config import ReportConfig
from schemas.agent import MAX_SEQ, Attempt, Name

REPORT_PATH = "/v1/checkpoint"

log = structlog.get_logger("muster.agent.report")


class ReportBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a pod posts: the attempt it belongs to, the checkpoint, and the attempt's token."""

    job_id: Name
    attempt: Attempt
    step: Annotated[int, Meta(ge=0, le=MAX_SEQ)]
    uri: Annotated[str, Meta(min_length=1, max_length=2048)]
    token: Annotated[str, Meta(max_length=128)] = ""


class Verdict(NamedTuple):
    """The answer to one report: an HTTP status and what it means for the sender."""

    status: int
    message: str
    recorded: bool = False


class Refused(Exception):
    """A report that is not taken; `status` is the 4xx to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_decoder = msgspec.json.Decoder(ReportBody)


def decode_report(body: bytes) -> ReportBody:
    """The report in a request body, or Refused(400) naming what is wrong with it."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise Refused(400, f"bad checkpoint report: {exc}") from None
    except msgspec.DecodeError as exc:
        raise Refused(
            400,
            f"bad checkpoint report: not valid JSON ({exc}); send a JSON object "
            '{"job_id", "attempt", "step", "uri", "token"}',
        ) from None


Accept = Callable[[ReportBody], Verdict]


class ReportServer:
    """The HTTP side: `accept` (the backend's) judges each decoded report."""

    def __init__(self, config: ReportConfig, accept: Accept, cluster: str = "") -> None:
        self.config = config
        self.accept = accept
        self.url = ""  # the base URL pods use, once started
        self.port = 0
        self.counts: dict[int, int] = {}  # answers by HTTP status
        self._runner: web.AppRunner | None = None
        self.log = log.bind(cluster=cluster)

    async def start(self) -> str:
        """Listen; the base URL pods are to use (the configured one, else the bound one)."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post(REPORT_PATH, self._handle)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            keepalive_timeout=self.config.timeout_s,  # idle connections do not pile up
        )
        await runner.setup()
        site = web.TCPSite(runner, self.config.listen_host, self.config.listen_port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.port = int(port)
        self.url = self.config.url.rstrip("/") or f"http://{host}:{self.port}"
        self.log.info("checkpoint report endpoint listening", port=self.port, url=self.url)
        return self.url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            with contextlib.suppress(Exception):
                await runner.cleanup()

    def _answer(self, verdict: Verdict) -> web.Response:
        self.counts[verdict.status] = self.counts.get(verdict.status, 0) + 1
        body: dict[str, object] = (
            {"recorded": verdict.recorded, "message": verdict.message}
            if verdict.status < 400
            else {"error": verdict.message}
        )
        return web.json_response(body, status=verdict.status)

    async def _handle(self, request: web.Request) -> web.Response:
        limit = self.config.max_body_bytes
        too_large = Verdict(413, f"report body over {limit} bytes; send one report")
        if request.content_length is not None and request.content_length > limit:
            return self._answer(too_large)
        try:
            raw = await asyncio.wait_for(request.read(), self.config.timeout_s)
        except TimeoutError:
            late = f"report body not sent within {self.config.timeout_s} s"
            return self._answer(Verdict(408, late))
        except web.HTTPRequestEntityTooLarge:
            return self._answer(too_large)
        try:
            verdict = self.accept(decode_report(raw))
        except Refused as exc:
            verdict = Verdict(exc.status, exc.message)
        except Exception as exc:  # the handler boundary: one bad report never stops the agent
            self.log.exception("checkpoint report failed", error=str(exc)[:300])
            verdict = Verdict(500, "the agent failed to take the report; retry")
        if verdict.status >= 400:
            why = verdict.message[:300]
            self.log.warning("checkpoint report refused", status=verdict.status, why=why)
        return self._answer(verdict)
