"""Where NATS is, and every place Muster works around nats-py: one module, so a nats-py
upgrade is checked here (tests/shell/test_natsio.py pins the versions).

- `flush`: nats-py's flush, ordered after what was sent before it;
- `Requester`: request/reply over one shared wildcard inbox, without nats-py's per-request setup;
- `submit_request`: a submission as every client sends it, its reply subject also in a header;
- `js_api_prefix`, `js_connection`: what a JetStream context holds only in private attributes;
- `deliver_inline`: a subscription's messages handed over as they are parsed, without a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.client import JetStreamContext

from schemas.subjects import REPLY_HEADER

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

# The nats-py releases whose private attributes below were read and tested (`_flush_pending`,
# `JetStreamContext._prefix`, `JetStreamContext._nc`, `Subscription._pending_queue`).
# pyproject.toml pins the same range.
NATS_PY_TESTED = ("2.15", "2.16")


def default_state_dir() -> Path:
    """The broker's state directory: $MUSTER_STATE_DIR, else ./.muster."""
    return Path(os.environ.get("MUSTER_STATE_DIR") or ".muster")


def resolve_nats_url(explicit: str | None) -> str:
    """explicit -> $MUSTER_NATS -> <state_dir>/nats.url (written by an embedded broker) ->
    nats://127.0.0.1:4222."""
    if explicit:
        return explicit
    env = os.environ.get("MUSTER_NATS", "").strip()
    if env:
        return env
    with contextlib.suppress(OSError, UnicodeDecodeError):
        url = (default_state_dir() / "nats.url").read_text(encoding="utf-8").strip()
        if url:
            return url
    return DEFAULT_NATS_URL


async def flush(nc: Client, timeout: float = 2.0) -> None:
    """`nc.flush()`, but ordered after everything sent before it.

    nats-py (2.15 and 2.16) writes flush's PING straight to the socket, ahead of commands still
    queued for its flusher task. So a flush right after `subscribe()` can return before the
    server has the SUB, and a publish from another connection a moment later is lost (see
    tests/shell/test_natsio.py, which fails within a few rounds without this). Handing the
    queue to the flusher first, and waiting for it, restores the order the API promises."""
    async with asyncio.timeout(timeout):
        await nc._flush_pending(force_flush=True)
        await nc.flush(int(timeout) + 1)  # the timeout above is the one that counts


def js_api_prefix(js: JetStreamContext) -> str:
    """The JetStream API subject prefix (`$JS.API`, or a domain's), for requests nats-py
    has no call for (one outstanding pull request, see broker/intake.py SubmitPuller)."""
    prefix: str = js._prefix
    return prefix


class _Inline:
    """Stands in for a subscription's pending queue: nats-py's reader puts each parsed
    message into it (`put_nowait`), and a subscription without a callback has no task
    taking from it, so nothing else is ever asked of it but its size."""

    def __init__(self, take: Callable[[Msg], None]) -> None:
        self.put_nowait = take

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass


def deliver_inline(sub: Subscription, take: Callable[[Msg], None]) -> None:
    """Hand each message of `sub`, made without a callback, to `take` as nats-py's reader
    parses it: no pending queue, no task and no callback coroutine per message (a third of
    nats-py's own cost in a 100,000-record read). `take` runs inside the reader, so it must
    not raise and must not block."""
    sub._pending_queue = _Inline(take)  # type: ignore[assignment]


def js_connection(js: JetStreamContext) -> Client:
    """The connection a JetStream context publishes on."""
    nc: Client = js._nc
    return nc


class Requester:
    """Request/reply over one wildcard inbox: replies resolve futures found by a counter token.

    nats-py's `request` draws a NUID and random bytes and wraps the wait in `wait_for` on
    every call, which was a tenth of the broker's time at 1,000 dispatches/s. Errors are the
    same: NoRespondersError when nobody listens, nats' TimeoutError when no reply came."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = ""
        self._sub: Any = None
        self._next = 0
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        async with self._starting:  # callers at once share one subscription
            if self._sub is None:
                prefix = self.nc.new_inbox() + "."
                self._sub = await self.nc.subscribe(
                    prefix + "*",
                    cb=self._on_reply,
                    pending_msgs_limit=-1,
                    pending_bytes_limit=-1,
                )
                self.prefix = prefix

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._waiting.pop(msg.subject[len(self.prefix) :], None)
        if fut is not None and not fut.done():
            if msg.headers and msg.headers.get("Status") == "503":
                fut.set_exception(NoRespondersError())
            else:
                fut.set_result(msg)

    async def ask(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None = None,
        *,
        reply_header: str | None = None,
    ) -> Asked:
        """Publish a request; `Asked.reply` gets the answer (NoRespondersError when nobody
        listens) for as long as the caller waits: `forget` it when done. `reply_header` names
        a header that carries the reply subject too (a stream keeps headers, not replies)."""
        if self._sub is None:
            await self.start()
        self._next += 1
        token = str(self._next)
        loop = asyncio.get_running_loop()
        asked = Asked(token, loop.create_future(), loop.time())
        self._waiting[token] = asked.reply
        reply = self.prefix + token
        if reply_header is not None:
            headers = {**(headers or {}), reply_header: reply}
        try:
            await self.nc.publish(subject, data, reply=reply, headers=headers)
        except BaseException:
            self._waiting.pop(token, None)
            raise
        return asked

    def forget(self, asked: Asked) -> None:
        """Stop waiting for a request's reply (a late one is then dropped)."""
        self._waiting.pop(asked.token, None)
        if not asked.reply.done():
            asked.reply.cancel()

    async def request(
        self,
        subject: str,
        data: bytes,
        timeout: float,
        headers: dict[str, str] | None = None,
        *,
        reply_header: str | None = None,
    ) -> Msg:
        asked = await self.ask(subject, data, headers, reply_header=reply_header)
        timer = asyncio.get_running_loop().call_later(timeout, _expire, asked.reply)
        try:
            return await asked.reply
        finally:
            timer.cancel()
            self.forget(asked)


_REQUESTERS: weakref.WeakKeyDictionary[Client, Requester] = weakref.WeakKeyDictionary()


def requester_of(nc: Client) -> Requester:
    """The connection's one Requester (one wildcard subscription however many callers)."""
    requests = _REQUESTERS.get(nc)
    if requests is None:
        requests = _REQUESTERS[nc] = Requester(nc)
    return requests


async def submit_request(
    nc: Client, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None
) -> Msg:
    """A submission as clients send it: a request whose reply subject also travels in the
    `Muster-Reply-To` header, since the submit stream keeps headers but not reply subjects;
    the broker answers the stored copy there even when it never heard this one (it was not
    leading yet). Errors as `Requester.request`."""
    return await requester_of(nc).request(
        subject, data, timeout, headers, reply_header=REPLY_HEADER
    )


@dataclass(slots=True, eq=False)
class Asked:
    """One request on the wire: its reply token, the future of its reply, when it was sent
    (event loop time)."""

    token: str
    reply: asyncio.Future[Msg]
    sent: float


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(NatsTimeoutError())
