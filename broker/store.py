"""Durable job records in a JetStream key-value bucket (one key per job).

Many records persist concurrently: `put_many` publishes every record to its KV subject with a
reply subject under one wildcard inbox of this store, and the caller awaits the acks of exactly
the records it depends on (a submission's ack, a dispatch's send). One future per call, not per
record: nats-py's `publish_async` costs a Task, a random token, a future and a JSON-decoded
PubAck per record, which was a tenth of the broker's time at 1,000 admissions/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, BadBucketError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from broker.attempts import MARKER_KEY
from broker.bucketread import last_seq_of, leader_state, read_newest, stream_seq
from broker.core.records import (
    RECORD_FORMAT,
    JobRecord,
    compact,
    record_encoder,
)
from broker.core.states import TERMINAL
from broker.core.storedrecord import stored_record_decoder
from broker.snapshot import NONE_WRITTEN, read_snapshot
from schemas.config import Replication
from schemas.subjects import snapshot_bucket_of
from shell.natsio import js_connection

log = structlog.get_logger("muster.store")

KV_OP = "KV-Operation"
PROBE_KEY = "_probe"  # no job id starts with "_"


ACK_TIMEOUT_S = 10.0  # a put not acknowledged by then is an error: the caller retries
_NO_RESPONDERS = "503"
_SEQ = re.compile(rb'"seq":\s*(\d+)')  # a PubAck's stream sequence
REPERSIST_CHUNK = 1000
SNAPSHOT_TURN = 5000  # records taken from a snapshot between two turns of the event loop
REBUILD_AFTER = 5  # write-backs in a row a listed stream leaves unanswered before it is rebuilt


def _contradicted(
    snapshot: frozenset[str], after: dict[str, int], target: int, messages: int
) -> str:
    """Why a read begun from a snapshot does not match the stream it read, or "". History 1
    keeps one message per key, so the stream holds as many messages as it has keys; a read
    that holds more kept a key purged without a marker after the snapshot (`muster
    store-compact`). Counted are the keys whose newest sequence is the target's or older, as
    the stream's info was when the target was read: every key of the snapshot that nothing
    after it replaced, and those written after it (`after`, each key's newest sequence)."""
    replaced = sum(1 for key in after if key in snapshot)
    held = len(snapshot) - replaced + sum(1 for seq in after.values() if seq <= target)
    if held != messages:
        return f"it and the messages after it hold {held} keys, the stream {messages}"
    return ""


def placement_of(replication: Replication) -> api.Placement | None:
    if replication.placement_cluster is None and not replication.placement_tags:
        return None
    return api.Placement(
        cluster=replication.placement_cluster, tags=list(replication.placement_tags) or None
    )


def _same_placement(have: api.Placement | None, want: api.Placement | None) -> bool:
    def key(p: api.Placement | None) -> tuple[str | None, tuple[str, ...]]:
        return (None, ()) if p is None else (p.cluster or None, tuple(sorted(p.tags or ())))

    return key(have) == key(want)


async def reconcile_replication(
    js: JetStreamContext, stream: str, replication: Replication
) -> api.StreamInfo:
    """Bring an existing stream (a KV bucket's included) to the configured replicas and
    placement. JetStream changes a stream's replica count in place: the new peers catch up
    from the leader, and nothing is lost or unavailable meanwhile; a placement change moves
    the stream to matching servers the same way. No placement in the config leaves the
    stream's own (one an operator set by hand) alone."""
    info = await js.stream_info(stream)
    want = placement_of(replication)
    if want is None:  # none configured: keep whatever placement the stream has
        want = info.config.placement
    have_replicas = info.config.num_replicas or 1
    if have_replicas == replication.replicas and _same_placement(info.config.placement, want):
        return info
    config = info.config
    config.num_replicas = replication.replicas
    config.placement = want
    try:
        info = await js.update_stream(config)
    except Exception as exc:
        raise _unplaceable(
            f"cannot change stream {stream} from {have_replicas} replicas", replication, exc
        ) from exc
    log.warning(
        "store.replication_changed",
        stream=stream,
        replicas_from=have_replicas,
        replicas=replication.replicas,
        placement=None if want is None else want.as_dict(),
    )
    return info


def _unplaceable(what: str, replication: Replication, exc: Exception) -> StoreError:
    want = placement_of(replication)
    return StoreError(
        f"{what} to {replication.replicas} replicas"
        + ("" if want is None else f" at placement {want.as_dict()}")
        + f": {exc}. JetStream keeps each replica on its own server, among the servers that "
        "match replication.placement_cluster and placement_tags (their server_tags), and a "
        "single nats-server keeps R1 only: set replication in the broker config to what the "
        "NATS servers offer, or add servers that match"
    )


KV_DUPLICATE_WINDOW_S = 120.0  # nats-py's for a KV bucket, shortened to a shorter TTL


def kv_stream_config(
    bucket: str,
    replication: Replication,
    *,
    ttl: float | None = None,
    max_bytes: int = -1,
    max_value_size: int = -1,
    description: str | None = None,
) -> api.StreamConfig:
    """The stream of a KV bucket that keeps one value per key, laid out as nats-py 2.16's
    `create_key_value` lays it out (nats ADR-8), with the configured placement. nats-py drops
    `placement` (nats-io/nats.py#538; its fix, PR #988, is not released): a bucket it made
    started wherever the server put it and moved only at the next start.
    tests/nats/test_replication.py checks this layout against nats-py's own."""
    window = min(KV_DUPLICATE_WINDOW_S, ttl) if ttl else KV_DUPLICATE_WINDOW_S
    return api.StreamConfig(
        name=f"KV_{bucket}",
        description=description,
        subjects=[f"$KV.{bucket}.>"],
        allow_rollup_hdrs=True,
        allow_msg_ttl=True,
        deny_delete=True,
        discard=api.DiscardPolicy.NEW,
        duplicate_window=window,
        max_age=ttl,
        max_bytes=max_bytes,
        max_consumers=-1,
        max_msg_size=max_value_size,
        max_msgs=-1,
        max_msgs_per_subject=1,
        num_replicas=replication.replicas,
        storage=api.StorageType.FILE,
        placement=placement_of(replication),
    )


async def open_bucket(
    js: JetStreamContext, config: api.StreamConfig, replication: Replication
) -> KeyValue:
    """Open the KV bucket whose stream is `config` (kv_stream_config), creating it when
    missing; an existing one is brought to the configured replicas and placement
    (reconcile_replication). Two brokers of one configuration creating it at once both open
    it: JetStream takes a stream created again with the same config as a no-op. Only a
    bucket found missing is created: a stream of its name that is not a bucket is refused,
    and a timeout is raised as it is (the bucket may exist)."""
    assert config.name is not None
    bucket = config.name.removeprefix("KV_")
    try:
        kv = await js.key_value(bucket)
    except BadBucketError:
        raise StoreError(
            f"stream {config.name} on this NATS account is not a key-value bucket (it keeps "
            f"more than one message per subject), so it cannot hold Muster's {bucket}: "
            "remove or rename that stream, or give this deployment another subject_prefix"
        ) from None
    except BucketNotFoundError:
        try:
            await js.add_stream(config)
        except APIError as exc:
            raise _unplaceable(f"cannot create bucket {bucket}", replication, exc) from exc
        return await js.key_value(bucket)
    await reconcile_replication(js, config.name, replication)
    return kv


class StoreError(Exception):
    """JetStream refused or did not acknowledge a record."""


class StreamUnanswered(StoreError):
    """The bucket's stream exists but nobody serves its subjects (NATS answered "no
    responders"): its server lost the stream's state and has not brought it back."""


class NewerRecords(RuntimeError):
    """The bucket holds job records of a format newer than this broker's: leading on them
    would drop what it does not understand from them (or forget their jobs)."""

    def __init__(self, too_new: dict[str, int], prefix: str) -> None:
        self.jobs = sorted(subject[len(prefix) :] for subject in too_new)
        self.newest = max(too_new.values())
        super().__init__(
            f"{len(self.jobs)} job records (e.g. {', '.join(self.jobs[:3])}) are of format "
            f"{self.newest}, newer than the {RECORD_FORMAT} this release of Muster understands: "
            "upgrade this broker or CLI (a newer broker leads on them meanwhile), or restore a "
            "backup this release wrote"
        )


class _Acks:
    """The acknowledgements one `put_many` call waits for."""

    __slots__ = ("future", "remaining")

    def __init__(self, future: asyncio.Future[None], remaining: int) -> None:
        self.future = future
        self.remaining = remaining


class StoreUsage:
    """What each queue's jobs hold in the job bucket: bytes of their newest records, and how
    many of them have not ended. The broker sums queues per team and refuses a submission
    that would take a team over its share (`limits.team_store_max_bytes`,
    `team_store_max_records`), so one team cannot fill the bucket every team writes to."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[str, int, bool]] = {}  # job -> (queue, bytes, active)
        self.bytes: dict[str, int] = {}  # per queue
        self.active: dict[str, int] = {}  # per queue: records of jobs that have not ended

    def note(self, record: JobRecord, size: int) -> None:
        """The record as just written (or read back at restore), `size` bytes."""
        job, queue = record.job_id, record.queue
        active = record.state not in TERMINAL
        old = self._jobs.get(job)
        self._jobs[job] = (queue, size, active)
        if old is not None and old[0] == queue:  # a job's later write: only the change
            self.bytes[queue] += size - old[1]
            if active != old[2]:
                self.active[queue] = self.active.get(queue, 0) + (1 if active else -1)
            return
        if old is not None:
            self._take_away(old)
        self.bytes[queue] = self.bytes.get(queue, 0) + size
        if active:
            self.active[queue] = self.active.get(queue, 0) + 1

    def forget(self, job_id: str) -> None:
        old = self._jobs.pop(job_id, None)
        if old is not None:
            self._take_away(old)

    def of(self, queues: frozenset[str] | set[str]) -> tuple[int, int]:
        """(bytes, active records) of these queues' jobs."""
        used = active = 0
        by_bytes, by_active = self.bytes, self.active
        for q in queues:
            used += by_bytes.get(q, 0)
            active += by_active.get(q, 0)
        return used, active

    def _take_away(self, old: tuple[str, int, bool]) -> None:
        queue, size, active = old
        self.bytes[queue] -= size
        if active:
            self.active[queue] -= 1


class JobStore:
    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        nc: Client | None = None,
        *,
        replication: Replication | None = None,
        max_bytes: int = 0,
        max_value_size: int = -1,
    ) -> None:
        self.js = js
        # How the bucket is made, to make it again if it is gone (BucketWatch).
        self.replication = replication or Replication()
        self.max_bytes = max_bytes
        self.max_value_size = max_value_size
        self.nc: Client = nc if nc is not None else js_connection(js)
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."
        self._inbox = ""
        self._sub: Any = None
        self._next = 0
        self._waiting: dict[str, _Acks] = {}
        # The highest stream sequence JetStream acknowledged for a record. Sequences only
        # grow, so a later ack or a stream's last sequence below it means the bucket lost
        # acknowledged records (a volume lost under an R1 bucket, or every replica lost).
        self.acked_seq = 0
        self.regressed = False
        self.usage = StoreUsage()

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str,
        replicas: int | Replication = 1,
        nc: Client | None = None,
        *,
        max_bytes: int = 0,
        max_value_size: int = -1,
    ) -> JobStore:
        """`max_bytes` 0: bounded by the server's store only. A full bucket refuses new
        writes (discard new, KV's policy) and the broker refuses submissions until it has
        room again; nothing already persisted is ever dropped to make room. An existing
        bucket is brought to the configured replicas and placement."""
        replication = (
            replicas if isinstance(replicas, Replication) else Replication(replicas=replicas)
        )
        layout = kv_stream_config(
            bucket,
            replication,
            max_bytes=max_bytes or -1,
            max_value_size=max_value_size,
            description="Muster job records",
        )
        await open_bucket(js, layout, replication)
        return cls(
            js,
            bucket,
            nc,
            replication=replication,
            max_bytes=max_bytes,
            max_value_size=max_value_size,
        )

    async def put(self, record: JobRecord) -> None:
        await self.put_many([record])

    async def put_many(self, records: list[JobRecord], timeout: float = ACK_TIMEOUT_S) -> None:
        """Persist records concurrently; returns when every one is acknowledged, raises when
        one is refused or not acknowledged within `timeout` (then some may have persisted: a
        put is idempotent, so the caller simply retries)."""
        if not records:
            return
        if self._sub is None:
            self._inbox = self.nc.new_inbox() + "."
            self._sub = await self.nc.subscribe(
                self._inbox + "*",
                cb=self._on_ack,
                pending_msgs_limit=-1,
                pending_bytes_limit=-1,
            )
        acks = _Acks(asyncio.get_running_loop().create_future(), len(records))
        tokens = []
        encode, publish, prefix, inbox = (
            record_encoder.encode,
            self.nc.publish,
            self.prefix,
            self._inbox,
        )
        try:
            sizes = []
            for record in records:
                self._next += 1
                token = str(self._next)
                tokens.append(token)
                self._waiting[token] = acks
                data = encode(record)
                sizes.append(len(data))
                await publish(prefix + record.job_id, data, reply=inbox + token)
            async with asyncio.timeout(timeout):
                await acks.future
            note = self.usage.note
            for record, size in zip(records, sizes, strict=True):
                note(record, size)
        except TimeoutError:
            raise StoreError(
                f"{acks.remaining} of {len(records)} records not acknowledged in {timeout}s"
            ) from None
        finally:
            for token in tokens:
                self._waiting.pop(token, None)

    async def _on_ack(self, msg: Msg) -> None:
        acks = self._waiting.pop(msg.subject[len(self._inbox) :], None)
        if acks is None or acks.future.done():
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            acks.future.set_exception(
                StreamUnanswered(f"no stream answers for bucket {self.bucket}")
            )
            return
        if b'"error"' in msg.data:
            try:
                error = json.loads(msg.data).get("error")
            except ValueError:
                error = msg.data[:200]
            if error:
                acks.future.set_exception(StoreError(f"JetStream refused a record: {error}"))
                return
        found = _SEQ.search(msg.data)
        if found is not None:
            seq = int(found[1])
            if seq < self.acked_seq:
                self.regressed = True
            else:
                self.acked_seq = seq
        acks.remaining -= 1
        if acks.remaining <= 0:
            acks.future.set_result(None)

    async def probe(self) -> None:
        """A write that changes no record: raises when the store refuses writes (full)."""
        ack = await self.js.publish(self.prefix + PROBE_KEY, b"", headers={KV_OP: "DEL"})
        if ack.seq <= 0:
            raise StoreError("JetStream did not store the probe")

    async def delete(self, job_id: str) -> None:
        await self.js.publish(self.prefix + job_id, b"", headers={KV_OP: "DEL"})
        self.usage.forget(job_id)

    async def load_all(self, limit_s: float = 60.0) -> list[JobRecord]:
        """Read the newest record of every job: a mirror that stops once caught up, so a cold
        start and a hot standby take records through the same code. Raises NewerRecords when
        some are of a newer format (a backup or a compaction must not rewrite or omit them)."""
        mirror = RecordMirror(self)
        try:
            records = await mirror.caught_up(limit_s)
            if mirror.too_new:  # a copy of them would drop what this release cannot read
                raise NewerRecords(mirror.too_new, self.prefix)
            return records
        finally:
            await mirror.stop()


class BucketWatch:
    """Notices that the job bucket lost records the leader holds, says so loudly and writes
    them back.

    An R1 bucket whose server comes back with an empty store (a lost volume) is recreated
    empty from the cluster's stream assignment, and writes go on landing in it: a leader
    serving from memory would never notice, and the records would be gone at the next
    takeover. Two signs, both exact: an ack whose sequence is below one acknowledged before
    (`JobStore.regressed`), or the stream's last sequence below the highest acknowledged
    one (the check for an idle leader). A stream that is gone is recreated. Either way every
    record in memory is persisted again: the leader is the only writer, so its records are
    the newest there are."""

    def __init__(self, store: JobStore, records: Callable[[], Iterable[JobRecord]]) -> None:
        self.store = store
        self.records = records
        self.losses = 0  # times a loss was found (a metric)
        self.repersisted = 0  # records written back
        # A loss found whose write-back has not completed yet (the recreated stream may have
        # no leader for a few seconds): the next check writes everything back again.
        self.owed = False
        self.unanswered = 0  # write-backs in a row the recreated stream did not answer
        self.rebuilt = 0  # times the bucket was deleted and created again (a metric)

    async def check(self) -> bool:
        """True when a loss was repaired. A write-back that fails (raises) is owed and tried
        again at the next check."""
        store = self.store
        if not self.owed:
            reason = await self._loss()
            if not reason:
                return False
            self.losses += 1
            log.error(
                "store.records_lost",
                bucket=store.bucket,
                reason=reason,
                records=len(list(self.records())),
                hint="a NATS server lost its JetStream store under a bucket with too few "
                "replicas; writing every record held in memory back. "
                "Set replication.replicas: 3",
            )
            store.acked_seq, store.regressed = 0, False
            self.owed = True
        records = list(self.records())
        try:
            for at in range(0, len(records), REPERSIST_CHUNK):
                await store.put_many(records[at : at + REPERSIST_CHUNK])
        except StreamUnanswered:
            self.unanswered += 1
            if self.unanswered >= REBUILD_AFTER:
                await self._rebuild()
            raise
        self.owed, self.unanswered = False, 0
        self.repersisted += len(records)
        log.warning("store.records_repersisted", bucket=store.bucket, records=len(records))
        return True

    async def _rebuild(self) -> None:
        """Delete the bucket's stream and create it again. A server that came back without
        its store can keep an R1 stream listed (empty) yet unserved for minutes; nothing in
        it is worth keeping, since the leader, the only writer, writes every record back."""
        store = self.store
        log.error(
            "store.bucket_rebuilt",
            bucket=store.bucket,
            unanswered=self.unanswered,
            why="the bucket's stream lost its records and has not answered since",
        )
        self.rebuilt += 1
        self.unanswered = 0
        with contextlib.suppress(NotFoundError):
            await store.js.delete_stream(store.stream)
        await self._reopen()

    async def _reopen(self) -> None:
        store = self.store
        await JobStore.open(
            store.js,
            store.bucket,
            store.replication,
            max_bytes=store.max_bytes,
            max_value_size=store.max_value_size,
        )

    async def _loss(self) -> str:
        """Why the bucket lost acknowledged records, or "" when it did not."""
        store = self.store
        # Read before asking: what was acknowledged by now is in the stream it describes.
        acked = store.acked_seq
        if store.regressed:
            return "an acknowledgement's sequence went backwards"
        try:
            info = await store.js.stream_info(store.stream)
        except NotFoundError:
            await self._reopen()
            return "the bucket's stream is gone"
        if info.state.last_seq < acked:
            last = info.state.last_seq
            return f"the stream's last sequence {last} is below the acknowledged {acked}"
        return ""


class RecordMirror:
    """The job bucket, followed live: the newest record of every job, kept in memory.

    A standby broker runs one while it waits for the lease, so on takeover it only waits for
    the last few writes instead of reading every record (~2.5 s at 100,000 jobs). It is an
    ordered push consumer, last per subject, that keeps running after the first pass; nats-py
    recreates it from the next stream sequence after a gap or a reconnect, and every message
    carries its stream sequence, so `applied` is always the newest sequence reflected here.

    Records are taken in the subscription's callback: `next_msg(timeout=...)` per record built
    a Task and a timer each time, ~145 us a record, most of a restart's time. A mirror asked
    for its records before it was started (a broker that leads at once, a backup) reads the
    bucket once instead, in batches (`broker.bucketread`), through the same taker."""

    # nats-py resets an ordered consumer after two missed heartbeats; its default (5 s) would
    # leave a mirror stale for 10 s after its consumer vanished (a NATS restart).
    IDLE_HEARTBEAT_S = 1.0

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._records: dict[str, JobRecord] = {}  # by KV subject
        self.applied = 0  # highest stream sequence applied
        self.usage = StoreUsage()  # what the records taken so far hold, per queue
        # KV subject -> format of a newest record newer than RECORD_FORMAT: kept out of
        # `_records` (never restored, so never rewritten with its unknown fields dropped).
        self.too_new: dict[str, int] = {}
        self._sub: Any = None
        self._target = 0
        self._reached: asyncio.Future[None] | None = None
        # The last sequence of the snapshot the last read began from (one the stream did not
        # contradict); 0: it read every record, or followed the bucket.
        self.snapshot_seq = 0

    @property
    def from_snapshot(self) -> bool:
        return self.snapshot_seq > 0

    async def start(self) -> None:
        if self._sub is not None:
            return
        take = self.taker()

        async def on_msg(msg: Msg) -> None:
            take(msg, stream_seq(msg))

        self._sub = await self.store.js.subscribe(
            self.store.prefix + ">",
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            idle_heartbeat=self.IDLE_HEARTBEAT_S,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1024 * 1024 * 1024,
        )

    def taker(self) -> Callable[[Msg, int], None]:
        """What takes each record message, live or in one read (`read_newest`)."""
        put = self.putter()

        def take(msg: Msg, seq: int) -> None:
            put(msg.subject, bool(msg.headers and msg.headers.get(KV_OP)), msg.data, seq)

        return take

    def putter(self) -> Callable[[str, bool, Any, int], None]:
        """What takes each record, from a message or from a snapshot, with what it needs in
        locals (a cold start runs it 100,000 times): `put(subject, marker, data, seq)`, where
        `marker` is a delete or purge marker (KV-Operation header). Records are keyed by their
        KV subject, which names the job; `seq` is the message's stream sequence. Their alike
        spec parts are decoded once and shared (broker/core/storedrecord.py)."""
        records, decode = self._records, stored_record_decoder.decode
        prefix = len(self.store.prefix)
        too_new = self.too_new

        def put(subject: str, marker: bool, data: Any, seq: int) -> None:
            # JetStream delivers in stream order, the last-per-subject pass included, so an
            # older sequence is one already applied: it must never replace a newer record.
            if seq <= self.applied:
                return
            self.applied = seq
            too_new.pop(subject, None)
            if subject[prefix] == "_":  # not a job: the probe, an epoch or attempt marker
                pass
            elif marker:
                records.pop(subject, None)  # deleted or purged
                self.usage.forget(subject[prefix:])
            else:
                try:
                    record = decode(data)
                    if record.format > RECORD_FORMAT:
                        records.pop(subject, None)
                        self.usage.forget(subject[prefix:])
                        too_new[subject] = record.format
                    else:
                        records[subject] = record
                        self.usage.note(record, len(data))
                except Exception as exc:  # a corrupt record must not stop recovery
                    # Its job is not restored, just as a cold load would not restore it.
                    records.pop(subject, None)
                    self.usage.forget(subject[prefix:])
                    log.error("store.corrupt_record", subject=subject, error=str(exc))
            reached = self._reached
            if reached is not None and seq >= self._target and not reached.done():
                reached.set_result(None)

        return put

    async def caught_up(self, timeout: float) -> list[JobRecord]:
        """The newest record of every job as of now: waits until the mirror has applied the
        stream's last sequence, read after this call began (so after the lease was won).

        A mirror not yet following the bucket (a restarted broker that led at once, a backup)
        reads it once instead, and does not follow it after: the bucket's snapshot
        (broker/snapshot.py) and what was written after it when the snapshot holds, else
        every record, in large batches (`read_newest`)."""
        once = self._sub is None and self.applied == 0
        plain = stored_record_decoder.plain_decodes
        if not once:
            await self.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Asked again while the stream has no leader (an R3 stream electing one), within the
        # same deadline as the read.
        info = await leader_state(self.store.js, self.store.stream, timeout)
        self._target = last_seq_of(info)
        self.snapshot_seq = 0
        if once and self._target:
            snapshot = await self._from_snapshot(info, deadline)
            if snapshot is not None:
                after: dict[str, int] = {}
                await self._read_to_target(deadline, after)
                why = _contradicted(snapshot, after, self._target, info.state.messages)
                if why:
                    log.warning("store.snapshot_unused", why=why)
                    self._forget()
        if not self.from_snapshot:
            await self._read_to_target(deadline, None, follow=not once)
        self.store.usage = self.usage  # kept as records were taken: nothing to add up now
        if stored_record_decoder.plain_decodes > plain:
            # Records are whole, but the shared-parts decode refused what it should take.
            log.warning(
                "store.records_decoded_plainly",
                records=stored_record_decoder.plain_decodes - plain,
                why="the shared-parts decode (broker/core/storedrecord.py) refused records the "
                "plain decoder took; they are restored, more slowly: report it with one record",
            )
        return list(self._records.values())

    async def _from_snapshot(self, info: api.StreamInfo, deadline: float) -> frozenset[str] | None:
        """Take the bucket's snapshot, if there is one that can stand for this stream: the
        keys it holds (None, having taken nothing, when there is none)."""
        loop = asyncio.get_running_loop()
        bucket = snapshot_bucket_of(self.store.bucket)
        got = await read_snapshot(self.store.js, bucket, info, deadline - loop.time())
        if isinstance(got, str):
            if got != NONE_WRITTEN:
                log.warning("store.snapshot_unused", why=got)
            return None
        put, data, at = self.putter(), got.data, 0
        for n, (subject, marker, size, seq) in enumerate(
            zip(got.subjects, got.markers, got.sizes(), got.seqs(), strict=True)
        ):
            put(subject, marker, data[at : at + size], seq)
            at += size
            if n % SNAPSHOT_TURN == SNAPSHOT_TURN - 1:
                await asyncio.sleep(0)  # the lease's renewals run meanwhile
        self.applied = got.last_seq
        self.snapshot_seq = got.last_seq
        return frozenset(got.subjects)

    async def _read_to_target(
        self, deadline: float, keys: dict[str, int] | None, *, follow: bool = False
    ) -> None:
        """Wait until the mirror has applied `_target`: as it follows the bucket (`follow`),
        or by one read from the sequence after `applied`, noting each key's sequence in
        `keys` when given."""
        loop = asyncio.get_running_loop()
        if self.applied >= self._target:
            return
        self._reached = loop.create_future()
        try:
            if follow:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await self._reached
                return
            take = self.taker()
            if keys is not None:
                plain_take = take

                def take(msg: Msg, seq: int) -> None:
                    keys[msg.subject] = seq
                    plain_take(msg, seq)

            # Bounded by its own deadline, so that it says why it stopped.
            await read_newest(
                self.store.js,
                self.store.stream,
                self.store.prefix + ">",
                take,
                self._reached,
                max(0.0, deadline - loop.time()),
                applied=lambda: self.applied,
            )
        finally:
            self._reached = None

    def _forget(self) -> None:
        """Drop every record taken: the next read starts from nothing."""
        self._records.clear()
        self.too_new.clear()
        self.applied = self.snapshot_seq = 0
        self.usage = StoreUsage()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, job_id: str) -> JobRecord | None:
        return self._records.get(self.store.prefix + job_id)

    async def stop(self) -> None:
        """Unsubscribe and forget the records: a leader keeps its own (`caught_up` returned
        them), and would otherwise keep every record it ever dropped alive here. Started
        again, the mirror reads the bucket from scratch."""
        sub, self._sub = self._sub, None
        if sub is not None:
            name = None
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    name = (await sub.consumer_info()).name
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if name:
                # An unsubscribed push consumer lives on in the server until its inactivity
                # threshold: a leadership storm once left hundreds behind, up to the limit.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await self.store.js.delete_consumer(self.store.stream, name)
        self._records, self.applied, self.usage = {}, 0, StoreUsage()
        self.too_new = {}


@dataclass
class CompactReport:
    records: int  # in the bucket
    compacted: int  # ended records whose workload was dropped
    expired: int  # ended records deleted (finished before the cut-off)
    bytes_before: int
    bytes_after: int


async def compact_bucket(
    js: JetStreamContext, bucket: str, *, expire_before: float | None, dry_run: bool = False
) -> CompactReport:
    """The operator's way to free the job bucket (`muster store-compact`), also when it is
    full and no broker can lead: ended records lose their workload (what the broker does
    itself when a job ends, so only records written before it did need this), and with
    `expire_before` ended records finished before then are deleted. A full bucket takes the
    smaller rewrite (history 1 replaces the record); should it refuse one, the old record is
    purged first (a purge frees space without a write). Safe beside a running broker: it
    never writes an ended record again."""
    store = JobStore(js, bucket)
    before = (await js.stream_info(store.stream)).state.bytes
    records = await store.load_all()
    compacted = expired = 0
    for record in records:
        if record.state not in TERMINAL:
            continue
        subject = store.prefix + record.job_id
        if expire_before is not None and (record.finished_at or 0.0) < expire_before:
            expired += 1
            if not dry_run:
                await js.purge_stream(store.stream, subject=subject)
            continue
        if not compact(record):
            continue
        compacted += 1
        if dry_run:
            continue
        try:
            await store.put_many([record])
        except StoreError:
            await js.purge_stream(store.stream, subject=subject)
            await store.put_many([record])
    if not dry_run:
        # Attempt markers of redelivered submissions (broker/attempts.py) leave a delete
        # marker each once cleared; purged here. A live one purged only lets its submission
        # be tried once more before it counts as poison.
        await js.purge_stream(store.stream, subject=store.prefix + MARKER_KEY + ".>")
        # The stream's last sequence may be a purged message now, which no reader would ever
        # be handed: a last write gives restores (`RecordMirror.caught_up`) one to reach.
        await store.probe()
    after = (await js.stream_info(store.stream)).state.bytes
    return CompactReport(len(records), compacted, expired, before, after)
