"""A small async Python client for Muster over nats-py.

    async with MusterClient(NatsOptions(url=resolve_nats_url(None))) as client:
        reply = await client.submit(spec, queue="ml-research")
        async for event in client.watch(reply.job_id):
            print(event.kind, event.cluster)

Everything is JSON on the client-facing subjects (`muster.submit.<queue>`, `muster.api.<verb>`,
`muster.events.job.<job_id>`), so this module is also the reference for clients in other
languages. Failures raise MusterError with a text meant for a person.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeoutError

from schemas.api import (
    TERMINAL_STATES,
    ApiReply,
    CancelRequest,
    ClusterView,
    Empty,
    JobEvent,
    JobRef,
    JobState,
    JobView,
    ListRequest,
    QueueView,
    SubmitReply,
    WhyView,
)
from schemas.codec import (
    DecodeError,
    decode_job_event,
    decode_submit_reply,
    encode_json,
    json_decoder,
)
from schemas.job import JobSpec
from schemas.natsopts import NatsOptions
from schemas.subjects import DEFAULT_SUBJECTS, REPLY_HEADER, Subjects
from shell.natsio import (
    DEFAULT_NATS_URL,
    default_state_dir,
    flush,
    requester_of,
    resolve_nats_url,
)

__all__ = [
    "DEFAULT_NATS_URL",
    "MusterClient",
    "MusterError",
    "default_state_dir",
    "new_job_id",
    "resolve_nats_url",
]

START_HINT = "is the broker running? start it with `muster broker`"
R = TypeVar("R")
DEFAULT_QUEUE = "default"  # a job that names no queue is published here (Kueue-style default)

# Reply decoders, built once (msgspec is fastest that way).
_decode_job = json_decoder(ApiReply[JobView], "reply")
_decode_jobs = json_decoder(ApiReply[list[JobView]], "reply")
_decode_why = json_decoder(ApiReply[WhyView], "reply")
_decode_queues = json_decoder(ApiReply[list[QueueView]], "reply")
_decode_clusters = json_decoder(ApiReply[list[ClusterView]], "reply")


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _check_schemes(url: str) -> None:
    """A URL NATS cannot speak (an `http://` one, say) fails with that, not with a DNS error."""
    for one in url.split(","):
        scheme, sep, rest = one.strip().partition("://")
        if sep and scheme.lower() not in NATS_SCHEMES:
            raise MusterError(
                f"--nats {one.strip()}: {scheme}:// is not a NATS URL; use nats://{rest} "
                f"(or tls://, ws://, wss://), the address of the NATS server, not of the "
                "dashboard or an HTTP monitor"
            )


class MusterError(Exception):
    """A request Muster refused or could not answer; `str()` says what to do."""


_JOB_ID_BAD = re.compile(r"[^A-Za-z0-9_-]+")


def new_job_id(name: str) -> str:
    """`<name>-<12 hex>`: readable, unique, and a valid subject token (so a client that times
    out still knows which job to ask about)."""
    stem = _JOB_ID_BAD.sub("-", name).strip("-_")[:50] or "job"
    return f"{stem}-{uuid.uuid4().hex[:12]}"


# -- the client --------------------------------------------------------------------------


class MusterClient:
    """Submit, inspect, cancel and watch jobs. One NATS connection per client."""

    def __init__(
        self, opts: NatsOptions | None = None, subjects: Subjects = DEFAULT_SUBJECTS
    ) -> None:
        self._opts = opts
        self.subjects = subjects
        self._nc: Client | None = None
        self._last_error: BaseException | None = None

    # connection ------------------------------------------------------------------------

    async def connect(
        self, opts: NatsOptions | None = None, subjects: Subjects | None = None
    ) -> MusterClient:
        """Connect (once). Fails fast with a clear text when NATS is not reachable."""
        if opts is not None:
            self._opts = opts
        if subjects is not None:
            self.subjects = subjects
        if self._nc is not None and self._nc.is_connected:
            return self
        options = self._opts or NatsOptions(url=resolve_nats_url(None))
        _check_schemes(options.url)
        kwargs = options.connect_kwargs()
        # A CLI must not hang: the first connect gets two quick tries; once connected, a blip
        # is ridden out by reconnecting for about half a minute.
        kwargs.update(
            allow_reconnect=True,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.2,
            connect_timeout=min(float(kwargs.get("connect_timeout", 5)), 5.0),
            error_cb=self._on_error,
            name=options.name or "muster-client",
        )
        try:
            self._nc = await nats.connect(**kwargs)
            self._nc.options["max_reconnect_attempts"] = 60
            self._nc.options["reconnect_time_wait"] = 0.5
            # One round trip proves the server took our CONNECT before we promise anything.
            await flush(self._nc, timeout=5)
        except (TimeoutError, NoServersError, OSError, NatsError) as exc:
            cause = self._last_error or exc
            detail = str(cause) or type(cause).__name__
            raise MusterError(
                f"cannot reach NATS at {options.url} ({detail}); {START_HINT}, "
                "or pass --nats URL / set MUSTER_NATS"
            ) from None
        return self

    async def _on_error(self, exc: BaseException) -> None:
        self._last_error = exc  # keep the cause; nats-py would otherwise log a traceback

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.drain()

    async def __aenter__(self) -> MusterClient:
        return await self.connect()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise MusterError("the client is not connected; call `await client.connect()` first")
        return self._nc

    @property
    def team(self) -> str | None:
        """The team this client acts as (its API calls and log reads go through the broker)."""
        return self._opts.team if self._opts else None

    # submit ----------------------------------------------------------------------------

    async def submit(
        self,
        spec: JobSpec | dict[str, Any],
        queue: str | None = None,
        timeout: float = 5,
        *,
        assign_id: bool = True,
    ) -> SubmitReply:
        """Publish a JobSpec to `muster.submit.<queue>` and wait for the broker's answer.

        The queue is the argument, else the spec's own, else `default` (the broker refuses
        that with a clear reason when its config has no such queue). Without a job_id the
        client assigns one (`assign_id`), so a timeout still leaves an id to ask about and a
        resubmission of the same spec is recognised as a duplicate. Raises MusterError when the
        broker rejects the job (the text is the broker's) or does not answer.
        """
        job = self._as_spec(spec)
        queue = queue or job.queue
        if queue and job.queue != queue:
            job = msgspec.structs.replace(job, queue=queue)
        if job.job_id is None and assign_id:
            job = msgspec.structs.replace(job, job_id=new_job_id(job.name))
        subject = self.subjects.submit(queue or DEFAULT_QUEUE)  # the spec still names none
        stored = f" as job {job.job_id}" if job.job_id else ""
        reply = await self.ask(
            subject,
            encode_json(job),
            decode_submit_reply,
            timeout,
            silent=f"nothing listens on {subject}; {START_HINT}",
            late=(
                f"no answer on {subject} within {timeout:g}s; {START_HINT}. If a broker ran "
                f"here before, the submission may be kept{stored} and run when it restarts"
            ),
            unreadable="the broker sent an unreadable submit reply",
            reply_header=REPLY_HEADER,
        )
        if not reply.accepted:
            raise MusterError(reply.error or "the broker rejected the job (no reason given)")
        return reply

    async def ask(
        self,
        subject: str,
        payload: bytes,
        decode: Callable[[bytes], R],
        timeout: float,
        *,
        silent: str,
        late: str,
        unreadable: str,
        reply_header: str | None = None,
    ) -> R:
        """One request and its decoded reply, for every request/reply this client and the
        operator's commands make. Each failure is a MusterError with the caller's text:
        `silent` when nothing listens, `late` when no answer comes within `timeout`,
        `unreadable` (then the decoder's reason) when the reply does not decode.

        A "no responders" answer is retried once after a moment, since it can also mean a
        responder that is just reconnecting (nobody got the first copy, so nothing is done
        twice).

        `reply_header` names a header that carries the reply subject too: a submission's, so
        the copy the submit stream stores can still be answered (docs/protocol.md)."""
        requests = requester_of(self.nc)
        try:
            try:
                msg = await requests.request(subject, payload, timeout, reply_header=reply_header)
            except NoRespondersError:
                await asyncio.sleep(0.2)
                msg = await requests.request(subject, payload, timeout, reply_header=reply_header)
        except NoRespondersError:
            raise MusterError(silent) from None
        except NatsTimeoutError:
            raise MusterError(late) from None
        try:
            return decode(msg.data)
        except DecodeError as exc:
            raise MusterError(f"{unreadable}: {exc}") from None

    @staticmethod
    def _as_spec(spec: JobSpec | dict[str, Any]) -> JobSpec:
        if isinstance(spec, JobSpec):
            return spec
        try:
            return msgspec.convert(spec, JobSpec)
        except msgspec.ValidationError as exc:
            raise MusterError(f"invalid JobSpec: {exc}") from None

    # API -------------------------------------------------------------------------------

    async def _call(self, verb: str, body: msgspec.Struct, decoder: Any, timeout: float) -> Any:
        team = self._opts.team if self._opts else None
        subject = self.subjects.api_as(team, verb) if team else self.subjects.api(verb)
        reply: ApiReply[Any] = await self.ask(
            subject,
            encode_json(body),
            decoder,
            timeout,
            silent=f"no broker answers on {subject}; {START_HINT}",
            late=f"no answer on {subject} within {timeout:g}s; {START_HINT}",
            unreadable=f"the broker sent an unreadable {verb} reply",
        )
        if not reply.ok:
            raise MusterError(reply.error or f"{verb} failed (the broker gave no reason)")
        if reply.result is None:
            raise MusterError(f"the broker's {verb} reply has no result")
        return reply.result

    async def get(self, job_id: str, timeout: float = 5) -> JobView:
        result: JobView = await self._call("get", JobRef(job_id=job_id), _decode_job, timeout)
        return result

    async def list(
        self,
        queue: str | None = None,
        state: JobState | None = None,
        cluster: str | None = None,
        limit: int = 1000,
        timeout: float = 5,
    ) -> builtins.list[JobView]:
        req = ListRequest(queue=queue, state=state, cluster=cluster, limit=limit)
        result: builtins.list[JobView] = await self._call("list", req, _decode_jobs, timeout)
        return result

    async def cancel(
        self, job_id: str, reason: str = "cancelled by user", timeout: float = 5
    ) -> JobView:
        req = CancelRequest(job_id=job_id, reason=reason)
        result: JobView = await self._call("cancel", req, _decode_job, timeout)
        return result

    async def why(self, job_id: str, timeout: float = 5) -> WhyView:
        result: WhyView = await self._call("why", JobRef(job_id=job_id), _decode_why, timeout)
        return result

    async def queues(self, timeout: float = 5) -> builtins.list[QueueView]:
        result: builtins.list[QueueView] = await self._call(
            "queues", Empty(), _decode_queues, timeout
        )
        return result

    async def clusters(self, timeout: float = 5) -> builtins.list[ClusterView]:
        result: builtins.list[ClusterView] = await self._call(
            "clusters", Empty(), _decode_clusters, timeout
        )
        return result

    # events ----------------------------------------------------------------------------

    async def watch(
        self,
        job_id: str,
        *,
        check_current: bool = True,
        idle_timeout: float | None = None,
        on_current: Callable[[JobView], None] | None = None,
    ) -> AsyncIterator[JobEvent]:
        """Yield the job's lifecycle events until one has a terminal state.

        Subscribes first, then (with `check_current`) asks the broker for the job, so a job
        that already ended stops the watch at once instead of waiting forever; an unknown job
        raises MusterError. `idle_timeout` ends the watch with MusterError after that many
        seconds without an event. Events that do not decode are skipped. `on_current` receives
        the job as it stands once subscribed (before any event is yielded).
        """
        team = self._opts.team if self._opts else None
        events = (
            self.subjects.team_events(team, job_id) if team else self.subjects.job_events(job_id)
        )
        sub = await self.nc.subscribe(events)
        try:
            if check_current:
                view = await self.get(job_id)
                if on_current is not None:
                    on_current(view)
                if view.state in TERMINAL_STATES:
                    return
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_timeout or 3600.0 * 24 * 365)
                except NatsTimeoutError:
                    if idle_timeout is None:
                        continue
                    raise MusterError(
                        f"no event for job {job_id} in {idle_timeout:g}s; `muster status "
                        f"{job_id}` shows where it is"
                    ) from None
                try:
                    event = decode_job_event(msg.data)
                except DecodeError:
                    continue
                yield event
                if event.state in TERMINAL_STATES:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
