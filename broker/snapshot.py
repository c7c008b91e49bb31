"""A snapshot of the job bucket: every key's newest message up to one stream sequence, in one
object of a JetStream object store, so that a restart reads a few hundred large messages and
then only what was written after them, instead of 100,000 records one message each.

A snapshot is a copy of what the bucket's stream held, read from the stream itself (never
from a broker's memory, which may run ahead of what was persisted), so whoever writes it, a
leader's writer or one a deposed leader left running, writes the truth as of `last_seq`:
every key whose newest message has a sequence up to `last_seq` is in it, with that message.
A reader takes it, then every message after `last_seq` (`RecordMirror.caught_up`), and checks
the result against the stream: the keys it holds must be as many as the stream's messages
(history 1: one message per key). A key purged without a marker since (`muster
store-compact`), a stream made again, a snapshot that cannot be read: the reader says why and
reads every record instead. Nothing is ever restored from a snapshot the stream contradicts.

The leader writes one in a process of its own (`python -m broker.snapshotwriter`, given the
connection and bucket on its standard input): reading the bucket costs about a CPU-second at
100,000 records, which would otherwise stall the broker's event loop while it serves.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import mmap
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
from msgspec import Meta
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, ObjectStore

from broker.bucketread import ReadStopped, StreamMissing, last_seq_of, leader_state

FORMAT = 1
OBJECT = "records"
GET_LIMIT_S = 20.0  # the longest a reader waits for the object's chunks
# Stored with the object (its headers, nats.Header's shape) so that a leader learns how recent
# the newest snapshot is from one small read, without reading the snapshot.
LAST_SEQ_HEADER = "Muster-Last-Seq"
STREAM_CREATED_HEADER = "Muster-Stream-Created"
NONE_WRITTEN = "none written yet"
CHUNKS_A_FETCH = 16  # 2 MiB of 128 KiB chunks a pull request
CHUNKS_INACTIVE_S = 10.0  # the server drops the reader's consumer by then if it dies mid-read
UNAVAILABLE_PAUSE_S = 0.2  # between two reads JetStream answered 503 (a leader changing)
PULLS_UNANSWERED = 5  # pulls in a row answered 503 before the read starts again on a new consumer


class RecordSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    """Columns, one entry per key, in stream order. `data` is every value end to end (a
    delete or purge marker has none); entry i's share of it is `sizes()[i]` bytes. The
    numeric columns are packed little-endian (`seqs` u64, `sizes` u32): a list of 100,000
    ints built as many objects, scattered among the records restored, and they kept their
    memory pages from going back to the system."""

    format: int
    # When the bucket's stream was created: a stream made again restarts its sequences.
    stream_created: str
    last_seq: Annotated[int, Meta(ge=1)]
    subjects: list[str]
    markers: list[bool]  # a delete or purge marker (KV-Operation header), not a value
    packed_seqs: memoryview
    packed_sizes: memoryview
    data: memoryview  # decoded without a copy: views of the object's bytes

    def __post_init__(self) -> None:
        n = len(self.subjects)
        if not (len(self.markers) == n and len(self.packed_seqs) == 8 * n):
            raise ValueError("a snapshot's columns differ in length")
        if len(self.packed_sizes) != 4 * n:
            raise ValueError("a snapshot's columns differ in length")
        if sum(self.sizes()) != len(self.data):
            raise ValueError("a snapshot's sizes do not add up to its data")
        if n and max(self.seqs()) > self.last_seq:
            raise ValueError("a snapshot holds a message after its last sequence")

    def seqs(self) -> Sequence[int]:
        return _column(self.packed_seqs, "Q")

    def sizes(self) -> Sequence[int]:
        return _column(self.packed_sizes, "I")


def packed(values: list[int], code: Literal["Q", "I"]) -> memoryview:
    """`values` as a little-endian column of array type `code` ("Q": u64, "I": u32)."""
    column = array(code, values)
    if sys.byteorder != "little":
        column.byteswap()
    return memoryview(column.tobytes())


def _column(raw: memoryview, code: Literal["Q", "I"]) -> Sequence[int]:
    if sys.byteorder == "little":
        view: memoryview[int] = raw.cast("B").cast(code)
        return view
    column = array(code, raw.tobytes())
    column.byteswap()
    return column


_decoder = msgspec.msgpack.Decoder(RecordSnapshot)


def objects_stream(bucket: str) -> str:
    """The stream behind object store `bucket` (nats-py's name for it)."""
    return OBJ_STREAM_TEMPLATE.format(bucket=bucket)


def _objects(js: JetStreamContext, bucket: str) -> ObjectStore:
    return ObjectStore(name=bucket, stream=objects_stream(bucket), js=js)


def created_of(info: api.StreamInfo) -> str:
    return info.created.isoformat() if info.created is not None else ""


def described(snapshot: RecordSnapshot) -> api.ObjectMeta:
    """The object's description as written: what `written_seq` reads back."""
    return api.ObjectMeta(
        name=OBJECT,
        headers={
            LAST_SEQ_HEADER: [str(snapshot.last_seq)],
            STREAM_CREATED_HEADER: [snapshot.stream_created],
        },
    )


async def written_seq(
    js: JetStreamContext, bucket: str, info: api.StreamInfo, limit_s: float
) -> int:
    """The last sequence of the newest snapshot in object store `bucket`, read from its
    description, if it stands for the stream `info` describes: 0 when there is none, its
    description does not say (an earlier release wrote it), the stream was made again since,
    or the store did not answer within `limit_s`. A leader that took over sets its next
    snapshot by it, instead of writing one at once that repeats the last."""
    try:
        async with asyncio.timeout(limit_s):
            headers = (await _objects(js, bucket).get_info(OBJECT)).headers or {}
        (seq,) = headers[LAST_SEQ_HEADER]
        (created,) = headers[STREAM_CREATED_HEADER]
        last = int(seq)
    except Exception:  # none, not said, not answered: as good as no snapshot
        return 0
    if created != created_of(info) or not 0 < last <= last_seq_of(info):
        return 0
    return last


async def read_snapshot(
    js: JetStreamContext, bucket: str, info: api.StreamInfo, limit_s: float
) -> RecordSnapshot | str:
    """The snapshot in object store `bucket`, if it can stand for the stream `info`
    describes; else why not. A store that does not answer yet (a cluster still electing its
    meta leader, which alone answers for a stream that does not exist) is asked again until
    `limit_s` (at most GET_LIMIT_S) has passed."""
    loop = asyncio.get_running_loop()
    limit = min(limit_s, GET_LIMIT_S)
    deadline = loop.time() + limit
    stream = objects_stream(bucket)
    try:
        await leader_state(js, stream, limit)
    except StreamMissing:
        return NONE_WRITTEN
    except ReadStopped as exc:
        return str(exc)
    unavailable: list[ServiceUnavailableError] = []  # the last 503, if any
    try:
        async with asyncio.timeout(max(0.0, deadline - loop.time())):
            blob = await _object_bytes_once_available(js, bucket, unavailable)
        snapshot = _decoder.decode(blob)
    except NotFoundError:
        return NONE_WRITTEN
    except TimeoutError:
        if unavailable:
            return f"JetStream answered {unavailable[-1]!r} for {limit:.0f} s"
        return f"its chunks did not all arrive in {limit:.0f} s"
    except Exception as exc:  # a digest that does not match, a chunk lost, a wrong shape
        return f"it cannot be read: {exc!r}"
    if snapshot.format != FORMAT:
        return f"it is of format {snapshot.format}, this broker reads {FORMAT}"
    if snapshot.stream_created != created_of(info):
        return "the bucket's stream was made again after it"
    if snapshot.last_seq > last_seq_of(info):
        return f"it ends at sequence {snapshot.last_seq}, after the stream's last"
    return snapshot


async def _object_bytes_once_available(
    js: JetStreamContext, bucket: str, unavailable: list[ServiceUnavailableError]
) -> mmap.mmap:
    """`_object_bytes`, asked again while JetStream answers 503 (the last answer is kept in
    `unavailable`). It does so for a moment while a meta or stream leader changes: the read's
    consumer cannot be made then, and the whole read of every record would be the price. The
    caller's deadline bounds it."""
    while True:
        try:
            return await _object_bytes(js, bucket, unavailable)
        except ServiceUnavailableError as exc:
            unavailable[:] = [exc]
            await asyncio.sleep(UNAVAILABLE_PAUSE_S)


async def _pulled(
    sub: JetStreamContext.PullSubscription,
    wanted: int,
    unavailable: list[ServiceUnavailableError],
) -> list[Msg]:
    """The next chunks, pulled again on the same consumer while JetStream answers 503 (the
    last answer is kept in `unavailable`). A pull answered 503 reached no consumer, so it
    took nothing: asked again, the read goes on where it was. The stream's leader changing
    under the read answers so for a moment; the read starts again on a new consumer only
    after PULLS_UNANSWERED such answers in a row (the consumer may be gone with its server)."""
    refused = 0
    while True:
        try:
            return await sub.fetch(wanted, timeout=GET_LIMIT_S)
        except ServiceUnavailableError as exc:
            unavailable[:] = [exc]
            refused += 1
            if refused >= PULLS_UNANSWERED:
                raise
            await asyncio.sleep(UNAVAILABLE_PAUSE_S)


async def _object_bytes(
    js: JetStreamContext, bucket: str, unavailable: list[ServiceUnavailableError]
) -> mmap.mmap:
    """The snapshot object's bytes, its digest checked. nats-py's `ObjectStore.get` reads
    the chunks through an ordered push consumer whose flow control waits on each window, and
    joins them by `bytes +=` (quadratic); pull requests of a few chunks each take them as
    fast as the server sends."""
    stream = objects_stream(bucket)
    info = await _objects(js, bucket).get_info(OBJECT)
    if not info.nuid or not info.digest:
        raise ValueError("the snapshot object's description names no chunks")
    sub = await js.pull_subscribe(
        OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid),
        stream=stream,
        config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=CHUNKS_INACTIVE_S,
        ),
    )
    total, size = info.chunks or 0, info.size or 0
    # A mapping of its own, not malloc's: a 22 MB block freed raises glibc's mmap threshold
    # to its size, and the restore's later large blocks then stayed in the heap.
    blob, at, digest = mmap.mmap(-1, max(size, 1)), 0, hashlib.sha256()
    try:
        # Taken a few chunks at a time into one buffer: every chunk of 22 MB held at once,
        # then joined, then copied by the decode, left a restarted broker larger.
        taken = 0
        while taken < total:
            wanted = min(CHUNKS_A_FETCH, total - taken)
            for msg in await _pulled(sub, wanted, unavailable):
                blob[at : at + len(msg.data)] = msg.data
                at += len(msg.data)
                digest.update(msg.data)
                taken += 1
    finally:
        with contextlib.suppress(Exception):
            name = (await sub.consumer_info()).name
            await sub.unsubscribe()
            await js.delete_consumer(stream, name)
    stated = info.digest.split("=", 1)[-1]  # "SHA-256=<base64url>"
    if at != size or digest.digest() != base64.urlsafe_b64decode(stated + "=" * (-len(stated) % 4)):
        raise ValueError("the snapshot object's bytes do not match its digest")
    return blob
