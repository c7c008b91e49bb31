"""Durable attempt markers for redelivered submissions, so that dead letters mean poison.

JetStream's delivery count says how often a submission was handed out, not why the earlier
deliveries went unacked: a broker that died (or lost the lead) while the job bucket was away
leaves a count that a later leader would read as "this message killed the broker". A
redelivery therefore writes a marker into the job bucket before it is processed, counting the
processing attempts that started with the store taking writes; a redelivery whose marker the
store does not take is put back (nak with a delay) uncounted. First deliveries write nothing:
the marker costs only redeliveries, never the hot path. Markers are keyed by the submission's
stream sequence under a prefix no job id can have (job ids start with a letter or digit), and
carry the message's stored-at time, so a marker left over from a recreated stream whose
sequences started again does not count against a new message.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec
from msgspec import Meta
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

MARKER_KEY = "_attempts"  # keys `_attempts.<stream sequence>`; skipped by record readers
KV_OP = "KV-Operation"
WRITE_TIMEOUT_S = 2.0  # a store that answers nothing in this time counts as away


class AttemptMarker(msgspec.Struct, frozen=True):
    """Processing attempts of one stream message that started with the store present."""

    attempts: Annotated[int, Meta(ge=1, le=1_000_000)]
    stored_ns: Annotated[int, Meta(ge=0)]


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(AttemptMarker).decode


def attempts_of(data: bytes | None, stored_ns: int) -> int:
    """The attempts a marker counts for the message stored at `stored_ns`: 0 for a marker of
    another message (a recreated stream reuses sequences) or one that does not decode."""
    if not data:
        return 0
    try:
        marker = _decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    return marker.attempts if marker.stored_ns == stored_ns else 0


class AttemptMarkers:
    """The markers of one job bucket."""

    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self.js = js
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}.{MARKER_KEY}."

    async def begin(self, seq: int, stored_ns: int) -> int:
        """Count one more attempt of the message at stream sequence `seq` and return the
        attempts before it. Raises when the store does not read or take the marker (away,
        refusing writes, electing a leader): the caller puts the message back uncounted."""
        subject = self.prefix + str(seq)
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            before = await self._count(subject, stored_ns)
            ack = await self.js.publish(
                subject, _encode(AttemptMarker(attempts=before + 1, stored_ns=stored_ns))
            )
        if ack.seq <= 0:
            raise RuntimeError("JetStream did not store the attempt marker")
        return before

    async def _count(self, subject: str, stored_ns: int) -> int:
        try:
            last = await self.js.get_last_msg(self.stream, subject)
        except NotFoundError:
            return 0
        if last.headers and last.headers.get(KV_OP):
            return 0  # cleared
        return attempts_of(last.data, stored_ns)

    async def clear(self, seq: int) -> None:
        """Forget the marker once its message is acked or terminated. A delete (not a purge):
        a purged last message would leave the stream's last sequence one no reader is ever
        handed, and a restore waits for it."""
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await self.js.publish(self.prefix + str(seq), b"", headers={KV_OP: "DEL"})
