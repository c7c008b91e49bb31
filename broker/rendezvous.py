"""The reply rendezvous: a submitter's reply subject meets the outcome of its submission.

JetStream keeps a message's headers but not its reply subject. A client therefore also puts
its reply subject in the `Muster-Reply-To` header (`schemas.subjects.REPLY_HEADER`), and the
broker answers the stored copy there once its record persists, whether or not it heard the
plain copy: a submission stored before a broker led (its start, a failover's gap) is answered
too. For clients without the header (a bare `nats req`) the broker also hears the submit
subjects in plain NATS and keeps each reply subject here until the outcome of processing the
stored copy arrives (or the other way round). A broker never answers before the record
persists.

Who answers, once:
- a plain copy with the header is answered here only when the stream will never store it (too
  large, the store full, a subject no queue consumes, a retry of a known job the stream drops
  as a duplicate); otherwise it is dropped at once, with no pairing work: its stored copy
  answers. So is one whose stored copy was already taken from the stream and is not yet
  answered (a loaded broker may hear the plain copy only then, and would take it for a retry
  of the job its stored copy just made);
- a stored copy with the header is answered on the header once its record persists, unless
  its plain copy was answered early (the stream stored it after all: `answered`, kept
  `REPLY_TTL_S`);
- a stored copy is answered after its ack (`broker/intakeloop.py`), so a broker that dies
  before acking never answered it, and the redelivery to the next leader is the one answer.
  Only a redelivery after a lost ack is answered again, with the same outcome (the job, now
  `duplicate`): its requester took the first answer and stopped listening. Remembering every
  answer to prevent that would cost memory per submission for a case the client ignores;
- a header naming a subject the plain path would not answer either (no inbox, the broker's
  own inbox, not a literal subject) is refused: logged, counted in `refused["reply_header"]`
  (`muster_refused_messages_total{handler="reply_header"}`), and nothing is sent anywhere. The
  submission itself is processed as any other.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker import tenancy
from schemas.api import SubmitReply
from schemas.codec import encode_json
from schemas.subjects import REPLY_HEADER

log = structlog.get_logger("muster.rendezvous")

REPLY_TTL_S = 60.0


REPLY_MAX = 200_000


class _NamedJob(msgspec.Struct):
    job_id: str | None = None


_named_job = msgspec.json.Decoder(_NamedJob)


RendezvousKey = tuple[str, str, bytes]

MAX_SUBJECT = 256  # longer than any inbox a NATS client makes


def literal_subject(subject: str) -> bool:
    """Whether a header's text is one subject a reply may be published on: printable, no
    wildcard and no empty token (NATS checked the plain reply subject; nobody checks a
    header)."""
    return (
        0 < len(subject) <= MAX_SUBJECT
        and subject.isprintable()
        and " " not in subject
        and all(t and t not in ("*", ">") for t in subject.split("."))
    )


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
        refused: Counter[str] | None = None,
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
        # (header reply subject, submission) -> when its plain copy was answered, because the
        # stream was not expected to store it: its stored copy, if any, is not answered again
        self.answered: OrderedDict[tuple[str, RendezvousKey], float] = OrderedDict()
        # (header reply subject, submission) -> when its stored copy was taken from the stream;
        # until it is answered there, its plain copy is dropped (a plain copy that arrives
        # late would find the job known and answer it as a duplicate of itself)
        self.taken: OrderedDict[tuple[str, RendezvousKey], float] = OrderedDict()
        self.refused: Counter[str] = Counter() if refused is None else refused

    @staticmethod
    def key(subject: str, data: bytes, headers: dict[str, str] | None) -> RendezvousKey:
        """A message identity (`Nats-Msg-Id`), else the payload's digest."""
        msg_id = headers.get("Nats-Msg-Id") if headers else None
        if msg_id:
            return ("id", subject, msg_id.encode())
        return ("bytes", subject, hashlib.blake2b(data, digest_size=16).digest())

    async def on_request(self, msg: Msg) -> None:
        """A plain copy: answered here only when its stored copy never will be; otherwise
        its reply subject waits for the outcome, unless the header carries it."""
        header = msg.headers.get(REPLY_HEADER) if msg.headers else None
        if header is not None:
            key = self.key(msg.subject, msg.data, msg.headers)
            if (header, key) in self.taken:
                return  # its stored copy is being processed, and answers on the header
            early = self._unstored_reply(msg)
            if early is not None:
                # Should the stream store it after all (outside its duplicate window), the
                # stored copy stays silent: this request has its answer.
                self.answered[(header, key)] = time.monotonic()
                self._trim(self.answered)
                await self._answer_header(header, key, early)
            return  # the stored copy answers on the header
        if not msg.reply or not tenancy.reply_allowed(msg.reply, self.own_inbox):
            return
        early = self._unstored_reply(msg)
        if early is not None:
            await self.nc.publish(msg.reply, early)
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

    def _unstored_reply(self, msg: Msg) -> bytes | None:
        """The answer to a submission the stream will not store (too large, the store full, a
        subject no queue consumes) or will drop (a retry of a known job), else None: its
        stored copy gets the answer."""
        if len(msg.data) > self.limit:
            error = (
                f"JobSpec is {len(msg.data)} bytes, over the limit of {self.limit} bytes; "
                "send a smaller message"
            )
            return encode_json(SubmitReply(accepted=False, error=error))
        full = self.full()
        if full:  # the stream cannot store it either (same store)
            return encode_json(SubmitReply(accepted=False, error=full))
        return self.known(msg)

    async def _answer_header(self, reply: str, key: RendezvousKey, payload: bytes) -> None:
        """Answer on a header's reply subject, only one the plain path would answer too, so
        the header never makes the broker a relay."""
        if not (literal_subject(reply) and tenancy.reply_allowed(reply, self.own_inbox)):
            self.refused["reply_header"] += 1
            log.warning(
                "rendezvous.reply_header_refused",
                subject=key[1],
                reply=reply[:MAX_SUBJECT].encode("unicode_escape").decode(),
            )
            return
        try:
            await self.nc.publish(reply, payload)
        except Exception as exc:  # one submitter's header must not stop a batch's answers
            self.refused["reply_header"] += 1
            log.warning("rendezvous.reply_header_failed", subject=key[1], error=str(exc)[:200])

    def taking(
        self, subject: str, data: bytes, headers: dict[str, str] | None
    ) -> RendezvousKey | None:
        """A stored copy taken from the stream, to be answered by `on_result`: its plain copy,
        should it come only now, is dropped. A retry under the same identity has a reply
        subject of its own, so it is still answered as a duplicate. Returns the copy's key
        when it made one, for `on_result` (a digest of the payload is not made twice)."""
        header = headers.get(REPLY_HEADER) if headers else None
        if header is None:
            return None
        key = self.key(subject, data, headers)
        self.taken[(header, key)] = time.monotonic()
        self._trim(self.taken)
        return key

    async def on_result(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        payload: bytes,
        key: RendezvousKey | None = None,
    ) -> None:
        """A stored copy's outcome, its record persisted: answered on its header, else
        paired with a plain copy's reply subject. `key`: what `taking` returned for it."""
        if key is None:
            key = self.key(subject, data, headers)
        header = headers.get(REPLY_HEADER) if headers else None
        if header is not None:
            self.taken.pop((header, key), None)
            if self.answered.pop((header, key), None) is None:  # else answered by its plain copy
                await self._answer_header(header, key, payload)
            return
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
    def _trim(table: OrderedDict[Any, Any]) -> None:
        """Drop the oldest entries past REPLY_TTL_S or REPLY_MAX; an entry is a time or a
        deque of (time, ...) items."""
        now = time.monotonic()
        while table:
            _, items = next(iter(table.items()))
            at = items if isinstance(items, float) else items[0][0] if items else None
            if len(table) <= REPLY_MAX and at is not None and now - at < REPLY_TTL_S:
                break
            table.popitem(last=False)
