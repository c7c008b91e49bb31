"""The shape every server an operator reaches on the agent directly shares (`logs.py`,
`nodeops.py`): one NATS request/reply subject, subscribed when the runtime starts and dropped
when it stops, each request size-checked and decoded before it is served, and anything wrong
with it answered with a typed refusal rather than silence, so the asker never waits out a
timeout for a request that could not be read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from agents.backend import Backend
from schemas.codec import DecodeError, encode_json

MAX_REQUEST_BYTES = 4096
Req = TypeVar("Req", bound=msgspec.Struct)


class Replier(Generic[Req]):
    """Subscribe, read a request (or say why it cannot be read), answer on its reply subject,
    stop. A subclass serves a readable request in `serve` and names its refusal texts."""

    too_large: ClassVar[str] = f"request over {MAX_REQUEST_BYTES} B"
    unreadable: ClassVar[str] = ""  # put before a decode error, to say which request it was

    def __init__(
        self,
        nc: Client,
        subject: str,
        cluster: str,
        backend: Backend,
        decode: Callable[[bytes], Req],
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.cluster = cluster
        self.backend = backend
        self._decode = decode
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subject, cb=self._on_request)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return  # a publish, not a request: there is nobody to answer
        await self.serve(msg.data, msg.reply)

    async def serve(self, data: bytes, reply: str) -> None:
        raise NotImplementedError

    def read(self, data: bytes) -> Req | str:
        """The request, or the refusal text when it is too large or does not decode."""
        if len(data) > MAX_REQUEST_BYTES:
            return self.too_large
        try:
            return self._decode(data)
        except DecodeError as exc:
            return f"{self.unreadable}{exc}"[:1000]

    async def send(self, reply: str, answer: msgspec.Struct) -> None:
        """Publish one answer; an asker that went away is not the server's failure."""
        with contextlib.suppress(Exception):
            await self.nc.publish(reply, encode_json(answer))
