"""The reply rendezvous: a submitter's reply subject meets the outcome of its submission.

JetStream does not keep a message's reply subject, so the broker also hears the submit
subjects in plain NATS and keeps each reply subject here until the outcome of processing the
stored copy arrives (or the other way round); a broker never answers before the record persists.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker import tenancy
from schemas.api import SubmitReply
from schemas.codec import encode_json

REPLY_TTL_S = 60.0


REPLY_MAX = 200_000


class _NamedJob(msgspec.Struct):
    job_id: str | None = None


_named_job = msgspec.json.Decoder(_NamedJob)


RendezvousKey = tuple[str, str, bytes]


def _names_its_job(data: bytes) -> bool:
    """Whether a submission names its job (`job_id`): then equal bytes are the same job."""
    if b'"job_id"' not in data:
        return False
    try:
        return bool(_named_job.decode(data).job_id)
    except (msgspec.DecodeError, ValueError):
        return False


class ReplyRendezvous:
    """Pairs a submission's reply subject with the outcome of processing it from the stream.

    JetStream does not keep a message's reply subject, so the broker also listens on the
    submit subjects in plain NATS and remembers reply subjects; whichever side arrives second
    sends the reply.

    A submission with an identity (a `Nats-Msg-Id` header, or a `job_id` in its body) is keyed
    by it, and its outcome answers every request waiting under that identity: copies that never
    reached the stream (a stream server down in a NATS cluster) leave requests behind that no
    outcome pairs with one to one, and pairing by position would answer each retry onto the
    previous, dead reply subject forever. Every copy of one identity is the same job, so one
    answer fits them all. Submissions without an identity (equal bytes are different jobs, each
    with its own derived id) are paired in arrival order, as nothing else tells them apart."""

    def __init__(
        self,
        nc: Client,
        limit: int,
        full: Callable[[], str | None],
        known: Callable[[Msg], bytes | None],
    ) -> None:
        self.nc = nc
        self.own_inbox = tenancy.inbox_prefix_of(nc)
        self.limit = limit
        self.full = full  # the storage-full error while the store refuses writes, else None
        # The reply for a retry of a job already accepted (same Nats-Msg-Id): the stream drops
        # such a duplicate, so it would never be answered otherwise.
        self.known = known
        self.waiting: OrderedDict[RendezvousKey, deque[tuple[float, str]]] = OrderedDict()
        self.done: OrderedDict[RendezvousKey, deque[tuple[float, bytes]]] = OrderedDict()

    @staticmethod
    def key(subject: str, data: bytes, headers: dict[str, str] | None) -> RendezvousKey:
        """A message identity (`Nats-Msg-Id`), else the payload's digest."""
        msg_id = headers.get("Nats-Msg-Id") if headers else None
        if msg_id:
            return ("id", subject, msg_id.encode())
        return ("bytes", subject, hashlib.blake2b(data, digest_size=16).digest())

    async def on_request(self, msg: Msg) -> None:
        if not msg.reply or not tenancy.reply_allowed(msg.reply, self.own_inbox):
            return
        if len(msg.data) > self.limit:
            # The stream refuses to store it, so the consumer will never see it: answer here.
            error = (
                f"JobSpec is {len(msg.data)} bytes, over the limit of {self.limit} bytes; "
                "send a smaller message"
            )
            await self.nc.publish(msg.reply, encode_json(SubmitReply(accepted=False, error=error)))
            return
        full = self.full()
        if full:
            # The stream cannot store it either (same store), so it would never be answered.
            await self.nc.publish(msg.reply, encode_json(SubmitReply(accepted=False, error=full)))
            return
        again = self.known(msg)
        if again is not None:
            await self.nc.publish(msg.reply, again)
            return
        key = self.key(msg.subject, msg.data, msg.headers)
        results = self.done.get(key)
        if results:
            _, payload = results.popleft()
            if not results:
                del self.done[key]
            await self.nc.publish(msg.reply, payload)
            return
        self.waiting.setdefault(key, deque()).append((time.monotonic(), msg.reply))
        self._trim(self.waiting)

    async def on_result(
        self, subject: str, data: bytes, headers: dict[str, str] | None, payload: bytes
    ) -> None:
        key = self.key(subject, data, headers)
        # Equal bytes naming a job_id are copies of one job: an identity, as a Nats-Msg-Id is.
        identified = key[0] == "id" or _names_its_job(data)
        replies = self.waiting.get(key)
        if replies:
            if identified:  # every copy of this job waiting: one answer fits them all
                del self.waiting[key]
                for _, reply in replies:
                    await self.nc.publish(reply, payload)
                return
            # The newest first: a retry's request whose first copy the stream never stored (a
            # NATS failover) leaves an older, abandoned reply subject here, and answering in
            # arrival order would answer only abandoned ones from then on. Identical bytes get
            # interchangeable answers, so the newest waiting request, the one a client is
            # still waiting on, takes this one.
            _, reply = replies.pop()
            if not replies:
                del self.waiting[key]
            await self.nc.publish(reply, payload)
            return
        done = self.done.setdefault(key, deque())
        if identified:
            done.clear()  # the newest outcome of the job answers a late request
        done.append((time.monotonic(), payload))
        self._trim(self.done)

    @staticmethod
    def _trim(table: OrderedDict[Any, deque[Any]]) -> None:
        now = time.monotonic()
        while table:
            _, items = next(iter(table.items()))
            if len(table) <= REPLY_MAX and items and now - items[0][0] < REPLY_TTL_S:
                break
            table.popitem(last=False)
