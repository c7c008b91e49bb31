"""Writing the job bucket's snapshot (broker/snapshot.py), and when the leader has one written.

The writer reads the bucket through the same batched read a restart uses (`read_newest`),
keeping each message as the stream holds it (no decode), and puts the result in the object
store. The leader runs it as a process of its own (`python -m broker.snapshotwriter`, given
a `SnapshotJob` on its standard input): reading 100,000 records costs about a CPU-second,
which would otherwise stall the event loop that serves submissions and agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from datetime import UTC, datetime
from typing import Annotated

import msgspec
import structlog
from msgspec import Meta
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_META_PRE_TEMPLATE, ObjectStore

from broker.bucketread import last_seq_of, leader_state, read_newest
from broker.snapshot import (
    FORMAT,
    OBJECT,
    RecordSnapshot,
    created_of,
    described,
    objects_stream,
    packed,
)
from broker.store import KV_OP, JobStore, placement_of, reconcile_replication
from schemas.config import Replication
from schemas.natsopts import NatsOptions
from schemas.subjects import snapshot_bucket_of

log = structlog.get_logger("muster.snapshot")

WRITE_LIMIT_S = 120.0  # the longest a writer may take, its read included
# Chunks no description names are dropped once idle this long: no writer still puts them.
UNNAMED_CHUNKS_IDLE_S = WRITE_LIMIT_S
_encoder = msgspec.msgpack.Encoder()


class SnapshotJob(msgspec.Struct, forbid_unknown_fields=True):
    """What the writer process is given on its standard input."""

    nats: NatsOptions
    bucket: str  # the job bucket
    replication: Replication = msgspec.field(default_factory=Replication)
    max_bytes: Annotated[int, Meta(ge=0)] = 0  # of the snapshot's object store; 0: unbounded


class SnapshotWritten(msgspec.Struct):
    last_seq: int
    keys: int
    bytes: int
    chunks_dropped: int = 0  # subjects of chunks no object names (drop_unnamed_chunks)


class _Described(msgspec.Struct):
    """The one field read of an object's description: the subject suffix of its chunks."""

    nuid: str = ""


_described_decoder = msgspec.json.Decoder(_Described)


async def write_snapshot(
    store: JobStore, *, replication: Replication | None = None, max_bytes: int = 0
) -> SnapshotWritten | None:
    """Read every key's newest message from the bucket and put them in the snapshot object;
    None when the bucket holds nothing."""
    js = store.js
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WRITE_LIMIT_S
    info = await leader_state(js, store.stream, WRITE_LIMIT_S)
    target = last_seq_of(info)
    if not target:
        return None
    entries: dict[str, tuple[int, bool, bytes]] = {}
    done: asyncio.Future[None] = loop.create_future()
    applied = 0

    def take(msg: Msg, seq: int) -> None:
        # Stream order: what was taken up to the sequence that resolves `done` is the image
        # as of it; what follows in the same delivery is left to the next snapshot.
        nonlocal applied
        if done.done() or seq <= applied:
            return
        applied = seq
        entries[msg.subject] = (seq, bool(msg.headers and msg.headers.get(KV_OP)), msg.data)
        if seq >= target:
            done.set_result(None)

    await read_newest(
        js,
        store.stream,
        store.prefix + ">",
        take,
        done,
        max(1.0, deadline - loop.time()),
        applied=lambda: applied,
    )
    ordered = sorted(entries.items(), key=lambda item: item[1][0])
    values = [b"" if marker else data for _, (_, marker, data) in ordered]
    snapshot = RecordSnapshot(
        format=FORMAT,
        stream_created=created_of(info),
        last_seq=applied,
        subjects=[subject for subject, _ in ordered],
        markers=[marker for _, (_, marker, _) in ordered],
        packed_seqs=packed([seq for _, (seq, _, _) in ordered], "Q"),
        packed_sizes=packed([len(v) for v in values], "I"),
        data=memoryview(b"".join(values)),
    )
    blob = _encoder.encode(snapshot)
    bucket = snapshot_bucket_of(store.bucket)
    objects = await _open_objects(js, bucket, replication, max_bytes)
    try:  # first: in a bounded store they may be what leaves no room for this object
        dropped = await drop_unnamed_chunks(js, bucket, UNNAMED_CHUNKS_IDLE_S)
    except Exception as exc:  # a later write drops them instead
        log.warning("store.snapshot_chunks_not_dropped", error=repr(exc)[:300])
        dropped = 0
    await objects.put(OBJECT, blob, meta=described(snapshot))
    return SnapshotWritten(
        last_seq=applied, keys=len(ordered), bytes=len(blob), chunks_dropped=dropped
    )


async def drop_unnamed_chunks(js: JetStreamContext, bucket: str, idle_s: float) -> int:
    """Purge the chunks in object store `bucket` that no object's description names and that
    nobody wrote to for `idle_s`: a writer killed or cut off mid-put leaves them, and so does
    the loser of two writers racing (each put purges only the chunks of the description it
    replaced), and nothing else would ever drop them. A writer still putting wrote within
    WRITE_LIMIT_S. Idle is judged by this host's clock against the server's timestamps: a
    clock far ahead of the server's could cut a write in progress, whose snapshot a reader
    then refuses (its digest) and reads every record instead. Returns the subjects purged."""
    stream = objects_stream(bucket)
    meta_pre = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj="")
    chunk_pre = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj="")
    info = await js.stream_info(stream, subjects_filter=f"$O.{bucket}.>")
    subjects = list((info.state.subjects or {}).keys())
    named = {
        _described_decoder.decode((await js.get_last_msg(stream, s)).data or b"{}").nuid
        for s in subjects
        if s.startswith(meta_pre)
    }
    unnamed = [s for s in subjects if s.startswith(chunk_pre) and s[len(chunk_pre) :] not in named]
    dropped = 0
    for subject in unnamed:
        last = (await js.get_last_msg(stream, subject)).time
        if last is not None and (datetime.now(UTC) - last).total_seconds() >= idle_s:
            await js.purge_stream(stream, subject=subject)
            dropped += 1
    return dropped


async def _open_objects(
    js: JetStreamContext, bucket: str, replication: Replication | None, max_bytes: int
) -> ObjectStore:
    """The snapshot's object store, made (or brought to the replication asked) first."""
    replication = replication or Replication()
    try:
        objects = await js.object_store(bucket)
    except BucketNotFoundError:
        return await js.create_object_store(
            bucket,
            config=api.ObjectStoreConfig(
                description="Muster: a snapshot of the job records",
                storage=api.StorageType.FILE,
                replicas=replication.replicas,
                placement=placement_of(replication),
                max_bytes=max_bytes or -1,
            ),
        )
    await reconcile_replication(js, objects_stream(bucket), replication)
    return objects


async def _write_from_stdin() -> int:
    job = msgspec.json.decode(sys.stdin.buffer.read(), type=SnapshotJob)
    import nats

    nc = await nats.connect(**job.nats.connect_kwargs(reconnects=2))
    try:
        store = JobStore(nc.jetstream(timeout=10), job.bucket, nc)
        written = await write_snapshot(store, replication=job.replication, max_bytes=job.max_bytes)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    sys.stdout.buffer.write(msgspec.json.encode(written) + b"\n")
    return 0


class Snapshots:
    """When the leader has a snapshot written, and the writer process that writes it.

    One is due, `gap_s` after the last try, once `after_writes` records were acknowledged
    since the last snapshot (the stream's sequences count writes), or once any were and
    none for `gap_s`: a burst's last writes are in a snapshot soon after it ends, so a
    restart in the quiet that follows reads nothing after the snapshot. One writer runs at a
    time; it is killed when it outlives WRITE_LIMIT_S or the leadership."""

    def __init__(
        self, job: SnapshotJob, *, after_writes: int, gap_s: float, now: float, last_seq: int = 0
    ) -> None:
        self.job = job
        self.after_writes = after_writes
        self.gap_s = gap_s
        self.last_seq = last_seq  # of the newest snapshot known (written, or restored from)
        self._tried_at = now
        self._acked_seq, self._acked_at = 0, now  # the newest write seen, and when
        self.written = 0
        self.failed = 0

    def learned(self, last_seq: int) -> None:
        """A snapshot up to `last_seq` is in the store (written by an earlier leader)."""
        self.last_seq = max(self.last_seq, last_seq)

    def due(self, acked_seq: int, now: float) -> bool:
        """`acked_seq`: the stream sequence of the newest record write acknowledged."""
        if acked_seq != self._acked_seq:
            self._acked_seq, self._acked_at = acked_seq, now
        behind = acked_seq - self.last_seq
        if self.after_writes <= 0 or behind <= 0 or now - self._tried_at < self.gap_s:
            return False
        return behind >= self.after_writes or now - self._acked_at >= self.gap_s

    async def write(self, now: float) -> SnapshotWritten | None:
        """Run one writer process: what it wrote, or None when it failed (logged). Never
        raises but for the leadership's end: a snapshot not written costs a slower restart,
        never the leadership."""
        self._tried_at = now
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "broker.snapshotwriter",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:  # no process to be had (limits, memory)
            return self._failed(f"the writer process did not start: {exc}")
        try:
            async with asyncio.timeout(WRITE_LIMIT_S):
                out, err = await proc.communicate(msgspec.json.encode(self.job))
        except TimeoutError:
            await _kill(proc)
            return self._failed(f"no result in {WRITE_LIMIT_S:.0f} s")
        except BaseException:  # the leadership ended: its writer with it
            await _kill(proc)
            raise
        try:
            if proc.returncode != 0:
                raise ValueError(f"exit {proc.returncode}")
            written = msgspec.json.decode(out.splitlines()[-1], type=SnapshotWritten | None)
        except (ValueError, IndexError):  # msgspec's errors are ValueErrors
            return self._failed(
                f"the writer said: {err.decode(errors='replace')[-2000:] or out[-200:]!r}"
            )
        if written is not None:
            self.last_seq = max(self.last_seq, written.last_seq)
            self.written += 1
            log.info(
                "store.snapshot_written",
                last_seq=written.last_seq,
                keys=written.keys,
                bytes=written.bytes,
                chunks_dropped=written.chunks_dropped,
                took_s=round(time.monotonic() - started, 3),
            )
        return written

    def _failed(self, why: str) -> SnapshotWritten | None:
        """None, counted and logged: what a write that failed gives."""
        self.failed += 1
        log.warning("store.snapshot_failed", why=why)
        return None


async def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(Exception):
        await proc.wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(_write_from_stdin()))
