"""The broker process: the pure core behind NATS.

Everything that touches the machine runs on the event loop between awaits, so the machine is
never entered twice at once. Effects leave through one ordered pipeline: records persist first,
then commands and events go out in the order the machine produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import os
import secrets
import signal
import socket
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.js import api
from nats.js.errors import NotFoundError

from broker import api as broker_api
from broker import intake, tenancy
from broker.ackwait import AckWaits
from broker.agentlink import AgentMailboxes
from broker.attempts import AttemptMarkers
from broker.core.effects import (
    Effect,
    Forget,
    Persist,
    Publish,
    Send,
    applied,
    refusal,
    split_reply,
)
from broker.core.inputs import (
    CYCLE,
    TICK,
    AgentBatch,
    Checkpoint,
    DispatchAcked,
    Restore,
    SubmitJob,
)
from broker.core.machine import Machine
from broker.core.records import RECORD_FORMAT
from broker.core.submission import derive_job_id
from broker.embedded import EmbeddedNats, free_port
from broker.intake import FairPuller, ensure_intake, intake_names, unknown_queue_error
from broker.lease import LeaderLease, LeadershipLost, highest_epoch, record_epoch
from broker.metrics import Metrics
from broker.pacing import cycle_due, next_cycle_at
from broker.store import (
    BucketWatch,
    JobStore,
    NewerRecords,
    RecordMirror,
    placement_of,
    reconcile_replication,
)
from schemas import healthz
from schemas.agent import (
    TERMINAL_PHASES,
    Applied,
    Cancel,
    CheckpointReport,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    EventBatch,
    WireRefused,
    WorkloadStatus,
)
from schemas.api import SubmitReply
from schemas.codec import (
    DecodeError,
    decode_command_ack,
    decode_event_batch,
    decode_jobspec,
    decode_json_object,
    encode_json,
    encode_msgpack,
    json_decoder,
)
from schemas.config import BrokerConfig, Replication
from schemas.job import JobSpec
from schemas.natsopts import NatsOptions
from schemas.subjects import Subjects
from schemas.wire import WIRE_VERSION, compatible
from shell.natsio import Asked, Requester, flush, js_api_prefix
from shell.natsstate import NatsStateLog
from shell.tasks import cancel_and_wait

log = structlog.get_logger("muster.broker")

# Lifecycle steps an operator follows at info level (queued and checkpointed are debug-worthy
# at load; `muster watch` shows them). "dispatched" is logged when the agent acks.
LIFECYCLE_LOGGED = frozenset(
    {"admitted", "running", "preempting", "requeued", "succeeded", "failed", "cancelled"}
)


def log_lifecycle(event: Any) -> None:
    """One info line per lifecycle step, with the job, cluster and attempt it concerns."""
    log.info(
        f"job {event.kind}",
        job_id=event.job_id,
        cluster=event.cluster,
        flavor=event.flavor,
        attempt=event.attempt,
        reason=event.reason,
    )


_checkpoint_decoder = json_decoder(CheckpointReport, "CheckpointReport")
FETCH_BATCH = 512
SUBMIT_INFLIGHT = 4  # fetched batches awaiting persistence at once
TICK_MIN_INTERVAL_S = 0.05
REPLY_TTL_S = 60.0
REPLY_MAX = 200_000
RESTORE_LIMIT_S = 60.0  # the longest a new leader waits for its records
STANDBY_RETRY_S = 0.5  # pause after a failed attempt to acquire the lease
NEWER_RECORDS_RETRY_S = 10.0  # lease left to a newer broker this long before trying again
BUCKET_CHECK_S = 1.0  # how often the leader checks the job bucket still holds its records
# A submission whose processing was attempted this many times without an ack (the broker died
# or failed while processing it) is not processed again: it goes to the dead-letter subject.
# Attempts are the first delivery and every redelivery whose attempt marker the job bucket
# took (broker/attempts.py): a redelivery while the store is away is put back uncounted.
MAX_DELIVERIES = 2
PUT_BACK_S = 2.0  # a redelivery whose attempt marker the store refused comes back after this
BUDGET_LOG_EVERY_S = 10.0  # per cluster: how often an agent over its budget is logged
WIRE_REFUSAL_EVERY_S = 10.0  # per cluster: how often an incompatible agent is logged and told
MAX_EXCUSED = 100_000  # excused stream sequences remembered (see Broker._hold_while_persisting)
LEASE_CHECK_MIN_INTERVAL_S = 1.0  # stale-epoch claims are checked against the lease this rarely
MAX_SUBMITTERS = 100_000  # token buckets kept at once
STORAGE_PROBE_S = 1.0
APPLIED_EVERY_S = 0.5  # batches without outcomes are acknowledged this often (fence renewal)
ID_KEY = "muster-id-key"  # submit-stream metadata: the secret behind server-derived job ids
STORAGE_FULL_MARKERS = ("insufficient", "resources", "maximum bytes", "storage")


class _WireOnly(msgspec.Struct):
    wire: str = ""


_wire_decoder = msgspec.msgpack.Decoder(_WireOnly)


def _peek_wire(data: bytes) -> str | None:
    """The wire version of a batch that did not decode in full; None when unreadable."""
    try:
        return _wire_decoder.decode(data).wire
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _storage_full(error: str) -> bool:
    text = error.lower()
    return any(marker in text for marker in STORAGE_FULL_MARKERS)


def _ack_tokens(msg: Msg) -> tuple[int, int, int]:
    """(times delivered, stream sequence, stored-at ns) from a JetStream message's ack subject,
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` or the longer form
    with domain and account hash."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"]:
        if len(tokens) == 9:
            return int(tokens[4]), int(tokens[5]), int(tokens[7])
        if len(tokens) >= 11:
            return int(tokens[6]), int(tokens[7]), int(tokens[9])
    meta = msg.metadata
    return meta.num_delivered, meta.sequence.stream, int(meta.timestamp.timestamp() * 1e9)


def _outcomes(batch: EventBatch) -> bool:
    """Whether the batch carries what an agent keeps until the broker acknowledges it."""
    for event in batch.events:
        if isinstance(event, CheckpointReport | ClusterSnapshot):
            return True
        if isinstance(event, WorkloadStatus) and event.phase in TERMINAL_PHASES:
            return True
    return False


class TokenBuckets:
    """Submission rate per submitter: `rate` per second sustained, `burst` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str, now: float) -> bool:
        if self.rate <= 0:
            return True
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > MAX_SUBMITTERS:
            self._buckets.popitem(last=False)
        return ok


def parse_submission(data: bytes, limit: int, queue: str | None) -> JobSpec:
    """A JSON JobSpec, or a Kubernetes manifest (PyTorchJob, MPIJob, ...) to derive one from."""
    if b'"apiVersion"' in data[:4096] and b'"kind"' in data:
        from broker.manifests import ManifestError, is_manifest, jobspec_from_manifest

        obj = decode_json_object(data, limit)
        if is_manifest(obj):
            try:
                return jobspec_from_manifest(obj, queue=queue)
            except ManifestError as exc:
                raise DecodeError(f"invalid manifest: {exc}") from None
    spec = decode_jobspec(data, limit)
    if spec.workload.manifest is None:
        return spec
    from broker.manifests import ManifestError, with_manifest_checked

    try:
        return with_manifest_checked(spec)
    except ManifestError as exc:
        raise DecodeError(f"invalid workload.manifest: {exc}") from None


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


class GcPacer:
    """Keeps Python's cycle collector from pausing the broker to re-walk every job record.

    Job records (and the core's per-job allocations, ~25 tracked objects a job) live long and
    form no cycles, yet each full collection walks all of them: ~0.2 s per 20,000 jobs, several
    times a minute under load, and every pause lands on submit -> dispatch latency. So what
    has survived FREEZE_EVERY_S is frozen (`gc.freeze`: reference counting still frees it, only
    the cycle detector skips it), and once per FULL_EVERY_S everything is unfrozen, fully
    collected and frozen again, so cyclic garbage that outlived a freeze is still reclaimed."""

    FREEZE_EVERY_S = 1.0
    FULL_EVERY_S = 600.0

    def __init__(self) -> None:
        self._next_freeze = 0.0
        self._next_full = 0.0

    def start(self, now: float) -> None:
        gc.freeze()  # what was just restored; no collection here: restart time counts
        self._next_freeze = now + self.FREEZE_EVERY_S
        self._next_full = now + self.FULL_EVERY_S

    def tick(self, now: float) -> None:
        if now >= self._next_full:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._next_full = now + self.FULL_EVERY_S
            self._next_freeze = now + self.FREEZE_EVERY_S
        elif now >= self._next_freeze:
            gc.freeze()
            self._next_freeze = now + self.FREEZE_EVERY_S


class Broker:
    def __init__(
        self,
        config: BrokerConfig,
        nc: Client,
        *,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
        pace_gc: bool = False,
        agent_nc: Client | None = None,
    ) -> None:
        """`pace_gc`: manage the process's cycle collector (GcPacer); the `muster broker`
        process turns it on, an in-process broker (tests) leaves the host's GC alone.
        `agent_nc`: a connection of its own for the agents' event subjects, so that however
        much agents send, nats-server can only cut that one as a slow consumer, never the
        connection that holds the lease, the store, the API and the submissions."""
        self.config = config
        self.nc = nc
        self.agent_nc = agent_nc or nc
        self.js = nc.jetstream(timeout=10)
        self.subjects = Subjects(prefix=config.subject_prefix)
        self._team_queues = tenancy.team_queues(config)
        self._team_of_queue = tenancy.team_of_queue(config)
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.clock = clock
        self.machine: Machine | None = None
        self.store: JobStore | None = None
        self.mirror: RecordMirror | None = None  # while standing by (see run)
        self.lease = LeaderLease(
            self.js,
            self.subjects.leader_bucket,
            self.holder,
            config.timeouts.lease_ttl_s,
            max_bytes=config.limits.lease_bucket_max_bytes,
            replication=config.replication,
        )
        self.leading = asyncio.Event()
        self.stopped = asyncio.Event()
        self._wake = asyncio.Event()
        self._queue: asyncio.Queue[tuple[list[Effect], asyncio.Future[None] | None]] = (
            asyncio.Queue()
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._subs: list[Any] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.stats = {
            "submitted": 0,
            "rejected": 0,
            "batches": 0,
            "events": 0,
            "bad_batches": 0,
            "dispatch_acked": 0,
            "dispatch_failed": 0,
            "dead_lettered": 0,
            "held_for_storage": 0,
            "put_back_for_storage": 0,
            "storage_full_rejections": 0,
            "store_quota_rejections": 0,
            "agent_dropped": 0,
            "rate_limited": 0,
            "stale_epoch_ignored": 0,
            "redispatched": 0,
            "ack_retries": 0,
            "late_acks": 0,
            "lead_failures": 0,
            "newer_records": 0,
            "store_records_lost": 0,
            "store_records_repersisted": 0,
        }
        # Messages refused by a handler's boundary (bad input or a failure processing it),
        # by handler: the broker answers or drops them with a reason and carries on.
        self.refused: Counter[str] = Counter()
        # stream sequence -> deliveries this process gave up on while their records waited
        # for the store (it stepped down): not the message's fault, so not counted as poison
        self._excused: OrderedDict[int, int] = OrderedDict()
        # The store refused a write for lack of space: a record (until one persists) or the
        # probe (until one lands). Either refuses new submissions.
        self._persist_full = False
        self._probe_full = False
        self._buckets = TokenBuckets(config.limits.submit_rate_per_s, config.limits.submit_burst)
        self._id_key = b""
        self._applied_sent: dict[str, tuple[str, int]] = {}
        self._applied_busy: set[str] = set()
        self._applied_at: dict[str, float] = {}
        self._lease_check_at = -1e18
        self._epoch_recorded = 0  # the epoch last written to the job bucket (see _take_epoch)
        self._mail: AgentMailboxes | None = None  # per-cluster agent budgets, while leading
        self._mail_wake = asyncio.Event()
        self._budget_logged: dict[str, float] = {}
        self._wire_refused_at: dict[str, float] = {}  # cluster -> when last logged and told
        self._rendezvous = ReplyRendezvous(
            nc, config.max_payload_bytes, self._storage_error, self._early_reply
        )
        self._requests = Requester(nc)
        self._ack_waits = AckWaits(config.timeouts)
        # (job_id, attempt) -> the Cancel of that attempt in flight (see Send.after_cancel_of)
        self._cancels: dict[tuple[str, int | None], asyncio.Task[Any]] = {}
        self.metrics = Metrics(self)
        self._gc = GcPacer() if pace_gc else None
        self._next_cycle = 0.0  # event-loop time before which no admission cycle starts
        self.restore_s = 0.0
        self.restored_jobs = 0

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        """Stand by until leading, serve, and go back to standby if leadership is lost.

        The standby is hot: a RecordMirror follows the job bucket while the lease is watched,
        so a takeover waits for the last few writes instead of reading every record. Each
        standby round starts a fresh mirror; a broker that leads at once pays a full read."""
        while not self.stopped.is_set():
            try:
                await self._ensure_streams()
                break
            except Exception as exc:  # NATS or JetStream not ready: retry, never exit
                log.warning("broker.streams_not_ready", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STANDBY_RETRY_S):
                        await self.stopped.wait()
        while not self.stopped.is_set():
            mirror = self.mirror = await self._start_mirror()
            try:
                if not await self._stand_by():
                    break
                try:
                    await self._lead(mirror)
                except LeadershipLost as exc:
                    log.warning("broker.leadership_lost", error=str(exc))
                except NewerRecords as exc:
                    # Let a broker that understands them lead; try again after a while.
                    self.stats["newer_records"] = len(exc.jobs)
                    log.error(
                        "broker.refused_to_lead",
                        jobs=exc.jobs[:10],
                        record_format=exc.newest,
                        understood=RECORD_FORMAT,
                        error=str(exc),
                    )
                    with contextlib.suppress(Exception):
                        await self.lease.release()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(NEWER_RECORDS_RETRY_S):
                            await self.stopped.wait()
                except Exception:  # never exit: stand by again and retry
                    self.stats["lead_failures"] += 1
                    log.exception("broker.lead_failed")
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(STANDBY_RETRY_S):
                            await self.stopped.wait()
                finally:
                    await self._step_down()
            finally:
                await mirror.stop()
                self.mirror = None
        with contextlib.suppress(Exception):
            await self.lease.release()

    async def _start_mirror(self) -> RecordMirror:
        assert self.store is not None
        mirror = RecordMirror(self.store)
        try:
            await mirror.start()
        except Exception as exc:  # NATS away: the mirror starts when the lease is won
            log.warning("broker.mirror_not_started", error=str(exc))
        return mirror

    async def _stand_by(self) -> bool:
        """Wait for the lease; False when the broker is stopped first. An acquire that fails
        (NATS away) is retried: only a lease actually won leads."""
        while True:
            acquire = asyncio.create_task(self.lease.acquire())
            stop = asyncio.create_task(self.stopped.wait())
            done, _ = await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                await cancel_and_wait(acquire)
                return False
            stop.cancel()
            error = acquire.exception()
            if error is None:
                return True
            log.warning("lease.acquire_failed", error=str(error))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STANDBY_RETRY_S):
                    await self.stopped.wait()

    async def stop(self) -> None:
        self.stopped.set()

    async def _ensure_streams(self) -> None:
        stream = self.subjects.submit_stream
        limits = self.config.limits
        cfg = api.StreamConfig(
            name=stream,
            subjects=[self.subjects.submit(q) for q in intake_names(self.config)],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            max_msg_size=self.config.max_payload_bytes,
            max_bytes=limits.submit_stream_max_bytes or -1,
            # Full: refuse new submissions, never drop accepted-but-unprocessed ones.
            discard=api.DiscardPolicy.NEW,
            no_ack=True,  # the broker answers the client itself; see ReplyRendezvous
            description="Muster submissions (kept while the broker is down)",
            metadata={ID_KEY: secrets.token_hex(16)},
            num_replicas=self.config.replication.replicas,
            placement=placement_of(self.config.replication),
        )
        try:
            info = await reconcile_replication(self.js, stream, self.config.replication)
        except NotFoundError:
            info = await self.js.add_stream(cfg)
        key = (info.config.metadata or {}).get(ID_KEY)
        if not key:
            # A stream made before ids were derived from it: key it now (kept for good).
            meta = {**(info.config.metadata or {}), ID_KEY: secrets.token_hex(16)}
            info.config.metadata = meta
            info = await self.js.update_stream(info.config)
            key = (info.config.metadata or {}).get(ID_KEY) or meta[ID_KEY]
        self._id_key = key.encode()
        # One consumer per queue, so one queue's flood never holds another's submissions.
        await ensure_intake(self.js, self.subjects, stream, intake_names(self.config))
        self.store = await JobStore.open(
            self.js,
            self.subjects.jobs_bucket,
            self.config.replication,
            nc=self.nc,
            max_bytes=limits.jobs_bucket_max_bytes,
        )

    async def _take_epoch(self) -> None:
        """Take an epoch above every one taken before (the lease bucket may have been lost
        and its revisions restarted) and record it in the job bucket, normally before any
        command carries it. A bucket that cannot be read fails this leadership (the restore
        needs it anyway); one that refuses writes (full, or refusing everything) must not keep
        a broker from leading and answering, so the record is then written by the bucket
        watch once the bucket takes it (`_record_epoch`)."""
        assert self.store is not None
        self._epoch_recorded = 0
        async with asyncio.timeout(10.0):
            self.lease.fence_above(await highest_epoch(self.store.js, self.store.bucket))
        await self._record_epoch()

    async def _record_epoch(self) -> None:
        """Write this leadership's epoch into the job bucket unless it is there already."""
        store, epoch = self.store, self.lease.epoch
        if store is None or self._epoch_recorded == epoch:
            return
        try:
            async with asyncio.timeout(2.0):
                await record_epoch(store.js, store.bucket, epoch, self.lease.holder)
        except Exception as exc:
            log.warning("broker.epoch_not_recorded", epoch=epoch, error=str(exc)[:200])
            return
        self._epoch_recorded = epoch

    async def _lead(self, mirror: RecordMirror) -> None:
        # Renew the lease from the moment it is won: restoring 100,000 records takes longer
        # than the lease TTL, and a lease left to expire meanwhile was lost right after the
        # restore, then won and restored again, over and over.
        hold = asyncio.create_task(self.lease.hold())
        try:
            await self._lead_holding(hold, mirror)
        finally:
            await cancel_and_wait(hold)

    async def _lead_holding(self, hold: asyncio.Task[None], mirror: RecordMirror) -> None:
        started = time.monotonic()
        self._persist_full = self._probe_full = False  # this leadership's own probe decides
        await self._take_epoch()
        machine = Machine(self.config, epoch=self.lease.epoch)
        # Loading builds millions of long-lived objects and no cycles; the cycle collector
        # would walk them again and again (it doubled restore time at 100,000 jobs).
        collecting = gc.isenabled()
        gc.disable()
        try:
            records = await mirror.caught_up(RESTORE_LIMIT_S)
            self.stats["newer_records"] = len(mirror.too_new)
            if mirror.too_new:
                raise NewerRecords(mirror.too_new, mirror.store.prefix)
            stream_seq = mirror.applied
            await mirror.stop()  # the leader does not mirror its own writes
            log.info(
                "broker.mirror_caught_up",
                records=len(records),
                stream_seq=stream_seq,
                catch_up_s=round(time.monotonic() - started, 3),
            )
            if hold.done():
                hold.result()  # leadership was lost while loading: raises LeadershipLost
            resend = machine.handle(Restore(records), self.clock())
        finally:
            if collecting:
                gc.enable()
        self.machine = machine
        if self._gc is not None:
            self._gc.start(time.monotonic())
        self.restore_s = time.monotonic() - started
        self.restored_jobs = len(records)
        log.info(
            "broker.leading",
            epoch=self.lease.epoch,
            jobs=len(records),
            restore_s=round(time.monotonic() - started, 3),
        )
        self._mail = AgentMailboxes(self.config.limits, time.monotonic())
        nc, s = self.nc, self.subjects
        self._subs = [
            await self.agent_nc.subscribe(
                s.agent_events_all,
                cb=self._on_agent_batch,
                pending_msgs_limit=-1,
                pending_bytes_limit=-1,
            ),
            await nc.subscribe(s.api_all, cb=self._on_api),
            await nc.subscribe(s.api_teams_all, cb=self._on_api),
            await nc.subscribe(
                s.submit_all, queue="muster-replies", cb=self._rendezvous.on_request
            ),
            await nc.subscribe(s.checkpoint_all, cb=self._on_sdk_checkpoint),
        ]
        await flush(nc)  # the server knows our subscriptions before we say we lead
        if self.agent_nc is not nc:
            await flush(self.agent_nc)
        # Agents that were already talking to the previous leader resync with us.
        for cluster in list(machine.agents):
            self._spawn(self._send_command(cluster, machine_resync(machine)))
        self.stats["redispatched"] += len(resend)
        if resend:
            log.info("broker.redispatching_unacknowledged", dispatches=len(resend))
            self._push(resend)
        self._tasks = [
            asyncio.create_task(self._pipeline()),
            asyncio.create_task(self._submissions()),
            asyncio.create_task(self._clock_loop()),
            asyncio.create_task(self._probe_storage()),
            asyncio.create_task(self._watch_bucket(machine)),
            asyncio.create_task(self._agent_worker()),
        ]
        self.leading.set()
        stop = asyncio.create_task(self.stopped.wait())
        waiters = {hold, stop, *self._tasks}
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        for task in done:
            if task is not stop and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def _watch_bucket(self, machine: Machine) -> None:
        """Check the job bucket still holds what it acknowledged (BucketWatch); a failed
        check (NATS away) is tried again at the next round."""
        assert self.store is not None
        watch = BucketWatch(self.store, lambda: list(machine.jobs.values()))
        while True:
            await asyncio.sleep(BUCKET_CHECK_S)
            await self.lease.proven.wait()
            try:
                if await watch.check():
                    self.stats["store_records_lost"] += 1
                    self.stats["store_records_repersisted"] = watch.repersisted
                    self._epoch_recorded = 0  # lost with the records: written again
            except Exception as exc:
                log.warning("store.check_failed", error=str(exc))
            await self._record_epoch()

    async def _step_down(self) -> None:
        self.leading.clear()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        await cancel_and_wait(*self._tasks, *self._background)
        self._tasks = []
        self._background = set()
        self._queue = asyncio.Queue()
        self.machine = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ effects
    def _push(self, effects: list[Effect], *, wait: bool = False) -> asyncio.Future[None] | None:
        if not effects and not wait:
            return None
        fut: asyncio.Future[None] | None = (
            asyncio.get_running_loop().create_future() if wait else None
        )
        self._queue.put_nowait((effects, fut))
        return fut

    async def _pipeline(self) -> None:
        assert self.store is not None
        while True:
            batch = [await self._queue.get()]
            # Let tasks that are already runnable (the admission cycle woken by the same
            # submissions) add their effects, so one put persists a job submitted and admitted
            # together instead of two.
            await asyncio.sleep(0)
            while not self._queue.empty() and len(batch) < 4096:
                batch.append(self._queue.get_nowait())
            # A lease suspended by a full server store is not proven ours: change nothing
            # (write, dispatch, cancel) until a renewal proves it again (broker/lease.py).
            await self.lease.proven.wait()
            records = {}
            for effects, _ in batch:
                for eff in effects:
                    if isinstance(eff, Persist):
                        records[eff.record.job_id] = eff.record
            await self._persist(list(records.values()))
            for effects, fut in batch:
                for eff in effects:
                    if isinstance(eff, Send):
                        if isinstance(eff.command, Dispatch):
                            self._spawn(
                                self._send_dispatch(eff.cluster, eff.command, eff.after_cancel_of)
                            )
                        elif isinstance(eff.command, Cancel):
                            self._track_cancel(eff.cluster, eff.command)
                        else:
                            self._spawn(self._send_command(eff.cluster, eff.command))
                    elif isinstance(eff, Forget):
                        self._spawn(self._forget(eff.job_id))
                    elif isinstance(eff, Publish):
                        event = eff.event
                        if event.kind in LIFECYCLE_LOGGED:
                            log_lifecycle(event)
                        body = encode_json(event)
                        await self.nc.publish(self.subjects.job_events(event.job_id), body)
                        team = self._team_of_job(event.job_id)
                        if team:
                            await self.nc.publish(
                                self.subjects.team_events(team, event.job_id), body
                            )
                if fut is not None and not fut.done():
                    fut.set_result(None)

    async def _forget(self, job_id: str) -> None:
        """Delete an expired job's record; a failure leaves it to the next leader's pass."""
        assert self.store is not None
        try:
            await self.store.delete(job_id)
        except Exception as exc:
            log.warning("broker.forget_failed", job_id=job_id, error=str(exc))

    async def _persist(self, records: list[Any]) -> None:
        assert self.store is not None
        delay = 0.05
        while records:
            try:
                await self.store.put_many(records)
                if self._persist_full:
                    log.warning("broker.storage_available", records=len(records))
                self._persist_full = False
                return
            except Exception as exc:  # NATS down: durability first, so wait and retry
                if _storage_full(str(exc)):
                    if not self._persist_full:
                        log.error("broker.storage_full", error=str(exc), records=len(records))
                    self._persist_full = True
                log.warning("broker.persist_retry", error=str(exc), records=len(records))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _request(self, cluster: str, data: bytes, attempts: int) -> CommandAck:
        """The agent's answer (with a stale epoch: the newer epoch it claims), or the refusal
        this side makes of its silence.

        Up to `attempts` copies, each waited for as long as the cluster's acks take
        (broker/ackwait.py); the ack of any copy sent so far counts. A refusal is final once
        no later copy is outstanding: the agent runs a job's commands one after the other,
        so a later copy may still be carried out, and then its ack is the truth."""
        subject = self.subjects.agent_cmd(cluster)
        waits = self._ack_waits.of(cluster)
        loop = asyncio.get_running_loop()
        asked: list[Asked] = []
        latest: Asked | None = None
        refused: CommandAck | None = None
        error = ""
        try:
            for i in range(attempts):
                if refused is not None:
                    return refused
                if i:
                    self.stats["ack_retries"] += 1
                try:
                    latest = await self._requests.ask(subject, data)
                    asked.append(latest)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                wait = waits.wait(i)
                deadline = loop.time() + wait
                while asked and (left := deadline - loop.time()) > 0:
                    done, _ = await asyncio.wait(
                        [a.reply for a in asked], timeout=left, return_when=asyncio.FIRST_COMPLETED
                    )
                    for a in [a for a in asked if a.reply in done]:
                        asked.remove(a)
                        try:
                            ack = decode_command_ack(a.reply.result().data)
                        except NoRespondersError:
                            error = f"no agent is listening for cluster {cluster!r}"
                            continue
                        except DecodeError as exc:
                            error = f"bad ack from cluster {cluster!r}: {exc}"
                            continue
                        waits.observe(loop.time() - a.sent)
                        if a is not latest:  # the old fixed wait would have dropped it
                            self.stats["late_acks"] += 1
                        if ack.ok or ack.stale_epoch or not asked:
                            return ack
                        refused = ack
                if asked:
                    error = f"agent of cluster {cluster!r} did not ack in {wait:.3g}s"
                elif refused is None and i + 1 < attempts:
                    await asyncio.sleep(min(0.1 * 2**i, 2.0))  # nothing on the wire: pause
            return refused if refused is not None else CommandAck(ok=False, error=error)
        finally:
            for a in asked:
                self._requests.forget(a)

    def _track_cancel(self, cluster: str, cmd: Cancel) -> None:
        """Remember the in-flight Cancel of a job's old attempt, so a Dispatch that the core
        ordered after it (`Send.after_cancel_of`) waits for it."""
        task = asyncio.create_task(self._cancel_until_heard(cluster, cmd))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        key = (cmd.job_id, cmd.attempt)
        self._cancels[key] = task

        def forget(done: asyncio.Task[Any]) -> None:
            if self._cancels.get(key) is done:
                del self._cancels[key]

        task.add_done_callback(forget)

    def _attempt_token(self, job_id: str, attempt: int) -> str:
        """The secret that lets one attempt's workload report its own checkpoints."""
        basis = f"checkpoint:{job_id}:{attempt}".encode()
        return hashlib.blake2b(basis, key=self._id_key, digest_size=16).hexdigest()

    async def _send_dispatch(self, cluster: str, cmd: Dispatch, after: int | None) -> None:
        cmd = msgspec.structs.replace(
            cmd, checkpoint_token=self._attempt_token(cmd.job_id, cmd.attempt)
        )
        cancel = self._cancels.get((cmd.job_id, after)) if after is not None else None
        if cancel is not None:
            # Until the old attempt's agent acknowledged its Cancel or its cluster is lost.
            await asyncio.wait({cancel})
        ack = await self._request(
            cluster, encode_msgpack(cmd), self.config.timeouts.dispatch_retries + 1
        )
        ok, error, stale = ack.ok, ack.error, (ack.epoch if ack.stale_epoch else None)
        # Bound only when there is something to say: binding costs as much as the request.
        bound = (
            log.bind(job_id=cmd.job_id, cluster=cluster, attempt=cmd.attempt)
            if stale is not None or not ok
            else log
        )
        if stale is not None:
            bound.warning("broker.stale_epoch", error=error, claimed=stale)
            await self._on_stale_epoch(cluster, stale, error)
            if not self.leading.is_set():
                return
        if not ok:
            self.stats["dispatch_failed"] += 1
            bound.warning("broker.dispatch_failed", error=error)
        else:
            self.stats["dispatch_acked"] += 1
            log.info(
                "job dispatched",
                job_id=cmd.job_id,
                cluster=cluster,
                attempt=cmd.attempt,
                flavor=cmd.flavor,
                resume_from_step=cmd.resume_from.step if cmd.resume_from else None,
            )
        machine = self.machine
        if machine is not None:
            self._push(
                machine.handle(
                    DispatchAcked(
                        cmd.job_id,
                        cmd.attempt,
                        ok,
                        error,
                        job_only=ack.job_only,
                        resize_refused=ack.resize_refused,
                    ),
                    self.clock(),
                )
            )

    async def _cancel_until_heard(self, cluster: str, cmd: Cancel) -> None:
        """A Cancel that a dispatch waits on is resent until its agent acknowledges it or the
        broker declares the cluster lost (its fence, minutes long, has lapsed by then)."""
        while not await self._send_command(cluster, cmd) and self.leading.is_set():
            track = self.machine.agents.get(cluster) if self.machine is not None else None
            if track is None or track.health == "lost":
                return
            await asyncio.sleep(self.config.timeouts.dispatch_ack_s)

    async def _send_command(self, cluster: str, cmd: Any) -> bool:
        ack = await self._request(cluster, encode_msgpack(cmd), 3)
        ok, error, stale = ack.ok, ack.error, (ack.epoch if ack.stale_epoch else None)
        if not ok:
            log.info(
                "broker.command_failed",
                cluster=cluster,
                command=type(cmd).__name__,
                job_id=getattr(cmd, "job_id", None),
                error=error,
            )
        if stale is not None:
            await self._on_stale_epoch(cluster, stale, error)
        return ok or stale is not None

    async def _on_stale_epoch(self, cluster: str, claimed: int, error: str) -> None:
        """An agent refused our epoch. Believed only when it claims a higher epoch than ours
        and the lease confirms a newer leader; checked at most once per
        LEASE_CHECK_MIN_INTERVAL_S, so a storm of such answers costs nothing."""
        epoch = self.lease.epoch
        now = time.monotonic()
        if claimed <= epoch or now - self._lease_check_at < LEASE_CHECK_MIN_INTERVAL_S:
            self.stats["stale_epoch_ignored"] += 1
            return
        self._lease_check_at = now
        if not await self.lease.confirm_newer(epoch):
            self.stats["stale_epoch_ignored"] += 1
            log.warning("broker.stale_epoch_unconfirmed", cluster=cluster, claimed=claimed)
            return
        await self._lose_leadership(f"agent of {cluster!r} saw epoch {claimed}: {error}")

    async def _lose_leadership(self, why: str) -> None:
        self.leading.clear()
        for task in self._tasks:
            task.cancel()
        log.error("broker.fenced", why=why)

    # ------------------------------------------------------------------ inputs
    async def _submissions(self) -> None:
        """Fetch, submit, and ack each message once its record is persisted. The next batch is
        fetched while earlier ones persist (at most SUBMIT_INFLIGHT batches), so the stream
        round trips and the persistence of one batch overlap the work of the next."""
        puller = FairPuller(
            self.nc,
            js_api_prefix(self.js),
            self.subjects.submit_stream,
            intake_names(self.config),
        )
        await puller.start()
        try:
            await self._submission_loop(puller)
        finally:
            await puller.stop()

    async def _submission_loop(self, puller: FairPuller) -> None:
        limit = self.config.max_payload_bytes
        inflight = asyncio.Semaphore(SUBMIT_INFLIGHT)
        while True:
            await inflight.acquire()
            try:
                msgs = await puller.next_batch(FETCH_BATCH, timeout=0.5)
            except ConnectionClosedError:
                inflight.release()
                return
            except Exception as exc:
                inflight.release()
                log.warning("broker.fetch_failed", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            if not msgs:
                inflight.release()
                continue
            replies: list[tuple[Msg, bytes, bool]] = []
            machine = self.machine
            assert machine is not None
            effects: list[Effect] = []
            known = False  # a copy of a job already submitted, maybe not persisted yet
            prior = await self._begin_attempts(msgs)
            for i, msg in enumerate(msgs):
                attempts = prior.get(i, 0)
                if attempts < 0:
                    continue  # put back: the store is away
                more: list[Effect] = []
                if attempts >= MAX_DELIVERIES:
                    reply, term = await self._dead_letter_reply(msg, attempts), True
                else:
                    reply, more, term = await self._submit_guarded(machine, msg, limit)
                effects.extend(more)
                known = known or (reply.accepted and reply.duplicate)
                replies.append((msg, encode_json(reply), term))
            # One entry for the whole batch: the pipeline keeps effects in order either way.
            # A batch that changed nothing (all refused, e.g. storage full) is answered at
            # once: it must not wait behind records the store cannot take. A copy of a known
            # job (a redelivery, a retry under another id) waits for the records ahead of it:
            # acking it before its job's record is durable could lose the job in a crash.
            persisted = self._push(effects, wait=True) if effects or known else None
            self._wake.set()
            self._spawn(self._ack_submissions(persisted, replies, inflight))

    async def _ack_submissions(
        self,
        persisted: asyncio.Future[None] | None,
        replies: list[tuple[Msg, bytes, bool]],
        inflight: asyncio.Semaphore,
    ) -> None:
        try:
            if persisted is not None:
                await self._hold_while_persisting(persisted, [r[0] for r in replies])
            for msg, payload, term in replies:
                with contextlib.suppress(Exception):  # unacked: redelivered, then dead-lettered
                    await (msg.term() if term else msg.ack())
                    delivered, seq, _ = _ack_tokens(msg)
                    if delivered > 1 and self.store is not None:  # it may have a marker
                        await AttemptMarkers(self.store.js, self.store.bucket).clear(seq)
                # The original subject is the stream message's subject.
                await self._rendezvous.on_result(msg.subject, msg.data, msg.headers, payload)
        finally:
            inflight.release()

    async def _hold_while_persisting(
        self, persisted: asyncio.Future[None], msgs: list[Msg]
    ) -> None:
        """Wait for the batch's records to persist, keeping each message's ack deadline alive
        meanwhile (`+WPI`): a store that is away or slow must not get the messages redelivered,
        which would count them towards the dead-letter limit as if they had killed the broker.
        A wait cut short (leadership lost) excuses these deliveries in this process."""
        every = intake.ACK_WAIT_S / 3
        try:
            while not persisted.done():
                await asyncio.wait({persisted}, timeout=every)
                if persisted.done():
                    break
                self.stats["held_for_storage"] += 1
                for msg in msgs:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
            persisted.result()
        except asyncio.CancelledError:
            for msg in msgs:
                with contextlib.suppress(Exception):
                    seq = _ack_tokens(msg)[1]
                    self._excused[seq] = self._excused.get(seq, 0) + 1
            while len(self._excused) > MAX_EXCUSED:
                self._excused.popitem(last=False)
            raise

    async def _begin_attempts(self, msgs: list[Msg]) -> dict[int, int]:
        """For each redelivered message of a batch (by index), the processing attempts before
        this one that started with the store present, counting the first delivery (no marker
        is written for it: the hot path) and not the deliveries this process excused. -1: the
        store did not take the marker, so the message was put back (nak with a delay) and
        this delivery counts for nothing."""
        redelivered: list[tuple[int, Msg, int, int]] = []
        for i, msg in enumerate(msgs):
            with contextlib.suppress(Exception):
                delivered, seq, stored_ns = _ack_tokens(msg)
                if delivered > 1:
                    redelivered.append((i, msg, seq, stored_ns))
        if not redelivered or self.store is None:
            return {}
        markers = AttemptMarkers(self.store.js, self.store.bucket)

        async def begin(msg: Msg, seq: int, stored_ns: int) -> int:
            try:
                before = 1 + await markers.begin(seq, stored_ns)
                # Deliveries this process gave up on while their records waited for the store
                # (it stepped down) are not the message's fault either.
                return max(0, before - self._excused.get(seq, 0))
            except Exception as exc:
                self.stats["put_back_for_storage"] += 1
                log.warning("broker.submission_put_back", seq=seq, error=str(exc)[:200])
                with contextlib.suppress(Exception):
                    await msg.nak(delay=PUT_BACK_S)
                return -1

        counts = await asyncio.gather(*(begin(m, seq, ns) for _, m, seq, ns in redelivered))
        return {i: n for (i, *_), n in zip(redelivered, counts, strict=True)}

    async def _dead_letter_reply(self, msg: Msg, attempts: int) -> SubmitReply:
        """Move a submission that failed processing `attempts` times to the dead-letter
        subject; the reply says so (the message is then terminated, not processed)."""
        queue = self.subjects.queue_of_submit_subject(msg.subject)
        seq = _ack_tokens(msg)[1]
        error = (
            f"submission failed processing {attempts} times (stream sequence {seq}); "
            "moved to the dead-letter subject. Check the job against the docs and "
            "submit a corrected one"
        )
        await self._dead_letter(msg, queue, error)
        return SubmitReply(accepted=False, error=error)

    async def _submit_guarded(
        self, machine: Machine, msg: Msg, limit: int
    ) -> tuple[SubmitReply, list[Effect], bool]:
        """The submission boundary: whatever a message holds, it is answered (accepted or
        rejected with a reason) and acked; it never raises. Returns (reply, effects,
        terminate)."""
        queue = self.subjects.queue_of_submit_subject(msg.subject)
        try:
            _, seq, stored_ns = _ack_tokens(msg)
        except Exception:
            seq, stored_ns = 0, 0
        full = self._storage_error()
        if full:
            return SubmitReply(accepted=False, error=full), [], False
        try:
            reply, effects = self._submit_one(machine, msg, limit, queue, seq, stored_ns)
        except Exception as exc:  # bad input the parsers did not foresee: refuse, carry on
            self.refused["submit"] += 1
            self.stats["rejected"] += 1
            log.warning("broker.submission_failed", queue=queue, seq=seq, error=repr(exc)[:300])
            error = f"the submission could not be processed: {type(exc).__name__}: {exc}"
            return SubmitReply(accepted=False, error=error[:1000]), [], False
        return reply, effects, False

    @property
    def storage_full(self) -> bool:
        # A lease suspended by a full server store counts too: the stream cannot store.
        suspended = self.leading.is_set() and not self.lease.proven.is_set()
        return self._persist_full or self._probe_full or suspended

    def _storage_error(self) -> str | None:
        if not self.storage_full:
            return None
        self.stats["storage_full_rejections"] += 1
        self.stats["rejected"] += 1
        if not self.lease.proven.is_set() and self.lease.suspended_for == "no-leader":
            return (
                "unavailable: JetStream is electing a leader for the broker's lease (a NATS "
                "server failover); retry in a few seconds with the same job_id"
            )
        return (
            "storage full: the broker cannot persist new jobs (the JetStream store or the job "
            "bucket is full); retry later. Operators: free or grow JetStream storage "
            "(see docs/operations.md, Limits and storage)"
        )

    async def _probe_storage(self) -> None:
        """Once a second, a tiny write to the job bucket (a delete marker under a key no job
        can have) tells whether the store takes writes: a full store is noticed before a job
        is lost to it, and submissions are refused with the reason instead of going
        unanswered (the submission stream cannot store them either)."""
        store = self.store
        assert store is not None
        for _ in range(10**9):
            try:
                async with asyncio.timeout(5.0):
                    await store.probe()
                self._probe_full = False
            except Exception as exc:
                if _storage_full(str(exc)):
                    if not self._probe_full:
                        log.error("broker.storage_full", error=str(exc), probe=True)
                    self._probe_full = True
            await asyncio.sleep(STORAGE_PROBE_S)

    async def _dead_letter(self, msg: Msg, queue: str | None, reason: str) -> None:
        self.stats["dead_lettered"] += 1
        self.refused["dead_letter"] += 1
        log.error("broker.dead_lettered", queue=queue, reason=reason)
        headers = {"Muster-Reason": reason[:1000], "Muster-Subject": msg.subject}
        with contextlib.suppress(Exception):
            await self.nc.publish(
                self.subjects.dead_letter(queue or "unknown"), msg.data, headers=headers
            )

    def _early_reply(self, msg: Msg) -> bytes | None:
        """A submission answered without the stream: one to a subject no queue consumes
        (the stream does not store it), or a retry of a known job."""
        queue = self.subjects.queue_of_submit_subject(msg.subject)
        error = unknown_queue_error(self.config, queue)
        if error is not None:
            self.stats["rejected"] += 1
            return encode_json(SubmitReply(accepted=False, error=error))
        return self._known_submission(msg)

    def _known_submission(self, msg: Msg) -> bytes | None:
        """The duplicate reply for a retried submission (same Nats-Msg-Id) of a known job."""
        machine = self.machine
        if machine is None or not msg.headers or not msg.headers.get("Nats-Msg-Id"):
            return None
        queue = self.subjects.queue_of_submit_subject(msg.subject)
        try:
            spec = parse_submission(msg.data, self.config.max_payload_bytes, queue)
        except Exception:
            return None  # the stream copy gets the full answer
        job_id = spec.job_id or derive_job_id(spec.name, self._id_token(msg, 0, 0))
        if job_id not in machine.jobs or tenancy.id_taken(
            machine, self._team_of_queue, job_id, queue
        ):
            return None  # the stream copy gets the full answer
        return encode_json(SubmitReply(accepted=True, job_id=job_id, duplicate=True))

    def _id_token(self, msg: Msg, seq: int, stored_ns: int) -> str:
        """An unguessable, stable suffix for a job submitted without `job_id`: keyed by the
        stream's secret, from the client's Nats-Msg-Id when it sets one (a retry with the same
        header is the same job), else from the stream message itself."""
        msg_id = msg.headers.get("Nats-Msg-Id") if msg.headers else None
        basis = f"id:{msg.subject}:{msg_id}" if msg_id else f"seq:{seq}:{stored_ns}"
        return hashlib.blake2b(basis.encode(), key=self._id_key, digest_size=6).hexdigest()

    def _submit_one(
        self, machine: Machine, msg: Msg, limit: int, queue: str | None, seq: int, stored_ns: int
    ) -> tuple[SubmitReply, list[Effect]]:
        try:
            spec = parse_submission(msg.data, limit, queue)
        except DecodeError as exc:
            self.stats["rejected"] += 1
            return SubmitReply(accepted=False, error=str(exc)), []
        submitter = f"{queue}/{spec.labels.get('user', '')}"
        if not self._buckets.take(submitter, time.monotonic()):
            self.stats["rate_limited"] += 1
            self.stats["rejected"] += 1
            rate = self.config.limits.submit_rate_per_s
            error = (
                f"rate limited: submitter {submitter!r} is over {rate:g} submissions/s "
                "(limits.submit_rate_per_s); slow down and retry"
            )
            return SubmitReply(accepted=False, error=error), []
        token = None if spec.job_id else self._id_token(msg, seq, stored_ns)
        taken = tenancy.id_taken(machine, self._team_of_queue, spec.job_id, queue)
        if taken:
            self.stats["rejected"] += 1
            return SubmitReply(accepted=False, error=taken), []
        over = None if spec.job_id in machine.jobs else self._store_quota_error(spec, queue, msg)
        if over:
            self.stats["store_quota_rejections"] += 1
            self.stats["rejected"] += 1
            return SubmitReply(accepted=False, error=over), []
        reply, effects = split_reply(
            machine.handle(
                SubmitJob(spec, order=seq or None, subject_queue=queue, id_token=token),
                self.clock(),
            )
        )
        if reply.accepted:
            self.stats["submitted"] += 1
            if not reply.duplicate:
                log.debug("broker.submitted", job_id=reply.job_id, queue=queue)
                if self.store is not None:  # counted at once: a burst must not overshoot
                    for eff in effects:
                        if isinstance(eff, Persist):
                            self.store.usage.note(eff.record, len(msg.data))
        else:
            self.stats["rejected"] += 1
            log.info("broker.rejected", queue=queue, error=reply.error)
        return reply, effects

    def _store_quota_error(self, spec: JobSpec, queue: str | None, msg: Msg) -> str | None:
        """The refusal of a submission that would take its team (or its queue, without one)
        over its share of the job bucket, else None."""
        limits = self.config.limits
        store = self.store
        if store is None or not (limits.team_store_max_bytes or limits.team_store_max_records):
            return None
        name = spec.queue or queue or ""
        name = self.config.queue_aliases.get(name, name)
        team = self._team_of_queue.get(name)
        queues = self._team_queues.get(team, frozenset()) if team else frozenset({name})
        used, active = store.usage.of(queues)
        owner = f"team {team!r}" if team else f"queue {name!r}"
        cap = limits.team_store_max_bytes
        if cap and used + len(msg.data) > cap:
            return (
                f"storage quota: {owner} holds {used:,} bytes of job records, and this job "
                f"({len(msg.data):,} bytes) would take it over its {cap:,} "
                "(limits.team_store_max_bytes); cancel or wait for jobs to end (an ended "
                "job's workload is dropped from its record), send smaller jobs, or ask an "
                "operator to raise the limit"
            )
        most = limits.team_store_max_records
        if most and active >= most:
            return (
                f"storage quota: {owner} has {active:,} unfinished jobs, its limit "
                "(limits.team_store_max_records); wait for some to end or cancel some"
            )
        return None

    async def _on_agent_batch(self, msg: Msg) -> None:
        """File the batch in its cluster's mailbox, undecoded (broker/agentlink.py): this
        callback must keep up with the socket whatever one agent sends."""
        mail = self._mail
        cluster = self.subjects.cluster_of_agent_subject(msg.subject)
        if mail is None or cluster is None:
            return
        now = time.monotonic()
        why = mail.offer(cluster, msg.data, now)
        if why is not None:
            if why != "coalesced":
                self.stats["agent_dropped"] += 1
            if now - self._budget_logged.get(cluster, -1e18) >= BUDGET_LOG_EVERY_S:
                self._budget_logged[cluster] = now
                log.warning(
                    "broker.agent_over_budget",
                    cluster=cluster,
                    reason=why,
                    dropped=sum(n for (c, _), n in mail.dropped().items() if c == cluster),
                    bytes=len(msg.data),
                )
        self._mail_wake.set()

    def agent_drops(self) -> dict[tuple[str, str], int]:
        """(cluster, reason) -> agent batches not applied: coalesced, over-budget."""
        return self._mail.dropped() if self._mail is not None else {}

    async def _agent_worker(self) -> None:
        """Apply the agents' batches, clusters in turn as their budgets allow, yielding after
        each so the API, submissions and the socket are served between any two."""
        mail = self._mail
        assert mail is not None
        while True:
            got = mail.take(time.monotonic())
            if isinstance(got, float):
                self._mail_wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(got):
                        await self._mail_wake.wait()
                continue
            cluster, data = got
            try:
                await self._agent_batch(cluster, data)
            except Exception as exc:  # the handler boundary: refuse, count, carry on
                self.refused["agent_batch"] += 1
                self.stats["bad_batches"] += 1
                log.exception("broker.batch_refused", cluster=cluster, error=repr(exc)[:300])
            await asyncio.sleep(0)

    async def _agent_batch(self, cluster: str, data: bytes) -> None:
        machine = self.machine
        if machine is None:
            return
        try:
            batch = decode_event_batch(data)
        except DecodeError as exc:
            # A batch of another major may not decode here: name its version if it has one.
            if not self._wire_ok(cluster, _peek_wire(data)):
                return
            self.stats["bad_batches"] += 1
            self.refused["agent_batch"] += 1
            log.warning("broker.bad_batch", cluster=cluster, error=str(exc)[:500])
            return
        if not self._wire_ok(cluster, batch.wire):
            return
        self.stats["batches"] += 1
        self.stats["events"] += len(batch.events)
        try:
            effects = machine.handle(AgentBatch(cluster, batch), self.clock())
        except Exception:  # a bug must not take the broker down; it is logged loudly
            self.stats["bad_batches"] += 1
            log.exception("broker.batch_failed", cluster=cluster, seq=batch.seq)
            return
        error = refusal(effects)
        if error:
            self.stats["bad_batches"] += 1
            log.warning("broker.rejected_batch", cluster=cluster, error=error)
        now = time.monotonic()
        if applied(effects) is not None and (
            now - self._applied_at.get(cluster, -1e18) >= APPLIED_EVERY_S or _outcomes(batch)
        ):
            # The agent keeps endings and checkpoints until told they are persisted, and
            # extends its workloads' fences from the time the acknowledged batch left.
            self._applied_at[cluster] = now
            persisted = self._push(effects, wait=True)
            self._spawn(self._acknowledge(cluster, batch.instance, batch.seq, persisted))
        else:
            self._push(effects)
        self._wake.set()

    def _wire_ok(self, cluster: str, wire: str | None) -> bool:
        """False for a batch whose wire major differs from ours: it is refused, counted, logged
        and the agent told why (at most every WIRE_REFUSAL_EVERY_S per cluster). Same major,
        any minor, is accepted; so is None (no version could be read: the caller's own
        checks refuse the batch)."""
        if wire is None or compatible(wire):
            return True
        self.refused["agent_wire"] += 1
        wire = wire[:16]  # as the schema bounds it: a batch that did not decode is unbounded
        now = time.monotonic()
        if now - self._wire_refused_at.get(cluster, -1e18) >= WIRE_REFUSAL_EVERY_S:
            self._wire_refused_at[cluster] = now
            reason = (
                f"wire version {wire!r} of cluster {cluster!r} is not compatible with this "
                f"broker's {WIRE_VERSION}: run an agent of major version "
                f"{WIRE_VERSION.split('.')[0]} (or upgrade the broker)"
            )
            log.error(
                "broker.agent_wire_refused",
                cluster=cluster,
                agent_wire=wire,
                broker_wire=WIRE_VERSION,
            )
            if self.machine is not None:
                cmd = WireRefused(
                    epoch=self.machine.epoch,
                    broker_wire=WIRE_VERSION,
                    agent_wire=wire,
                    reason=reason,
                )
                self._spawn(self._send_command(cluster, cmd))
        return False

    async def _acknowledge(
        self, cluster: str, instance: str, seq: int, persisted: asyncio.Future[None] | None
    ) -> None:
        """Tell the agent its outcomes up to `seq` are persisted. One Applied in flight per
        cluster; a newer seq that arrives meanwhile is sent when it returns."""
        if persisted is not None:
            await persisted
        sent = self._applied_sent.get(cluster)
        if sent is not None and sent[0] == instance and sent[1] >= seq:
            return
        self._applied_sent[cluster] = (instance, seq)
        if cluster in self._applied_busy:
            return
        self._applied_busy.add(cluster)
        try:
            done: tuple[str, int] | None = None
            while self._applied_sent.get(cluster) != done and self.machine is not None:
                done = self._applied_sent[cluster]
                cmd = Applied(epoch=self.machine.epoch, instance=done[0], seq=done[1])
                await self._send_command(cluster, cmd)
        finally:
            self._applied_busy.discard(cluster)

    async def _on_sdk_checkpoint(self, msg: Msg) -> None:
        machine = self.machine
        if machine is None:
            return
        try:
            report = _checkpoint_decoder(msg.data)
            if not hmac.compare_digest(
                report.token, self._attempt_token(report.job_id, report.attempt)
            ):
                raise ValueError(
                    f"checkpoint for {report.job_id} attempt {report.attempt} without that "
                    "attempt's MUSTER_CHECKPOINT_TOKEN; only its own replicas may report it"
                )
            effects = machine.handle(Checkpoint(report), self.clock())
        except Exception as exc:  # the handler boundary
            self.refused["checkpoint"] += 1
            log.warning("broker.bad_checkpoint", subject=msg.subject, error=str(exc)[:500])
            return
        self._push(effects)
        self._wake.set()

    async def _on_api(self, msg: Msg) -> None:
        machine = self.machine
        if machine is None or not msg.reply:
            return
        if not tenancy.reply_allowed(msg.reply, self._rendezvous.own_inbox):
            self.refused["api"] += 1  # a reply that is no inbox: the broker answers nobody
            return
        team, verb = tenancy.split_api_subject(self.subjects.prefix, msg.subject)
        if team is not None and verb == "logs":
            owned = self._team_queues.get(team, frozenset())
            routed = tenancy.forward_logs(team, owned, machine, self.subjects, msg.data)
            if isinstance(routed, bytes):
                await msg.respond(routed)
            else:  # the agent streams to the team's inbox; only the check is the broker's
                await self.nc.publish(routed[0], routed[1], reply=msg.reply)
            return
        if verb == "stats" and team is None:
            await msg.respond(encode_json(self.snapshot_stats()))
            return
        try:
            if team is None:
                payload, effects = broker_api.handle(machine, verb, msg.data, self.clock())
            else:
                owned = self._team_queues.get(team, frozenset())
                payload, effects = tenancy.handle_as(
                    team, owned, machine, verb, msg.data, self.clock()
                )
        except Exception as exc:  # the handler boundary: answer with the reason
            self.refused["api"] += 1
            log.warning("broker.api_failed", verb=verb, error=repr(exc)[:300])
            error = f"request could not be processed: {type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await msg.respond(encode_json({"ok": False, "error": error[:1000]}))
            return
        if effects:
            fut = self._push(effects, wait=True)
            if fut is not None:
                await fut
        await msg.respond(payload)

    def _team_of_job(self, job_id: str) -> str | None:
        record = self.machine.jobs.get(job_id) if self.machine is not None else None
        return self._team_of_queue.get(record.queue) if record is not None else None

    def snapshot_stats(self) -> dict[str, Any]:
        """Counters for operators and benchmarks (`muster.api.stats`)."""
        machine = self.machine
        return {
            **self.stats,
            "refused": dict(self.refused),
            "storage_full": self.storage_full,
            "lease_renew_failures": self.lease.renew_failures,
            "lease_recreated": self.lease.recreated,
            "lease_suspended": not self.lease.proven.is_set(),
            "epoch": self.lease.epoch,
            "restore_s": round(self.restore_s, 4),
            "restored_jobs": self.restored_jobs,
            "jobs": len(machine.jobs) if machine else 0,
            "pending": machine.views.pending_count() if machine else 0,
            "live": machine.views.live_count() if machine else 0,
            "clusters": len(machine.agents) if machine else 0,
            # asyncio or uvloop (`--event-loop`): which one a benchmark measured
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        }

    async def _clock_loop(self) -> None:
        """Timers and admission cycles: wakes on input, at least every 100 ms.

        A cycle has a fixed cost (the core rebuilds its candidate pools per gang shape) that
        dwarfs one job's. So after a cycle the next one waits CYCLE_GAP_FACTOR times as long as
        it took (at most CYCLE_MAX_GAP_S): under a stream of submissions the inputs of a few ms
        are admitted together, while a small or idle broker still admits at once. Timers are
        checked at most every TICK_MIN_INTERVAL_S."""
        loop = asyncio.get_running_loop()
        next_tick = 0.0
        while True:
            machine = self.machine
            if machine is None:
                return
            wait = 0.1
            if machine.wants_cycle:  # a cycle is deferred: come back when it is due
                wait = min(wait, self._next_cycle - loop.time())
            if wait > 0 and not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # no Task per wait, unlike wait_for
                        await self._wake.wait()
            self._wake.clear()
            started = loop.time()
            machine = self.machine
            if machine is None:
                return
            effects: list[Effect] = []
            if started >= next_tick:
                # Timers (start timeouts, preemption deadlines, backoff, silent agents) are
                # seconds long and were only ever checked every 100 ms when idle; checking
                # them on every wake cost a scan of every starting job each time.
                effects = machine.handle(TICK, self.clock())
                next_tick = started + TICK_MIN_INTERVAL_S
            effects.extend(self._cycle_if_due(machine))
            self._push(effects)
            for (cluster, flavor), state, cause in machine.lifecycle.health.drain_changes():
                log.warning(
                    "broker.dispatch_breaker",
                    cluster=cluster,
                    flavor=flavor,
                    state=state,
                    cause=cause,
                )
            if self._gc is not None:
                self._gc.tick(time.monotonic())
            await asyncio.sleep(0)

    def _cycle_if_due(self, machine: Machine) -> list[Effect]:
        """One admission cycle, unless the pause after the last one is not over (the clock
        loop then comes back when it is)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if not cycle_due(started, self._next_cycle, machine.wants_cycle):
            return []
        effects = machine.handle(CYCLE, self.clock())
        self._next_cycle = next_cycle_at(started, loop.time())
        return effects


def machine_resync(machine: Machine) -> Any:
    from schemas.agent import Resync

    return Resync(epoch=machine.epoch, reason="new leader")


# ---------------------------------------------------------------------- process entry
async def connect(opts: NatsOptions, name: str) -> Client:
    kwargs = opts.connect_kwargs()
    kwargs.setdefault("name", name)
    state = NatsStateLog(
        log,
        opts.url,
        "is nats-server running there? Without --nats, `muster broker` starts its own",
    )
    nc = await nats.connect(**kwargs, **state.callbacks())
    state.connected(nc)
    return nc


def _preferred_port(port: int = 4222) -> int:
    """The embedded NATS port: 4222 ($MUSTER_NATS_PORT), unless a live socket holds it.

    The probe binds with SO_REUSEADDR, as nats-server's own listener does: connections of the
    previous run left in TIME_WAIT must not move a restarted broker to a random port, which
    would strand every agent still dialling the old URL."""
    port = int(os.environ.get("MUSTER_NATS_PORT", port))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            log.warning("nats port taken; using a free one", port=port)
            return free_port()


def _lock_state_dir(state_dir: Path) -> Any:
    """One broker per state directory: its identity (and so its lease) lives there."""
    import fcntl

    handle = (state_dir / "broker.lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise SystemExit(
            f"another muster broker is using {state_dir}; give each broker its own --state-dir"
        ) from None
    return handle


def _broker_identity(state_dir: Path) -> str:
    """A stable name for this broker, so a restart reclaims its own lease at once."""
    path = state_dir / "broker-id"
    if not path.exists():
        path.write_text(f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}\n")
    return path.read_text().strip()


async def run_broker(
    *,
    config: BrokerConfig,
    nats: NatsOptions | None,
    state_dir: Path,
    holder: str | None = None,
    metrics_port: int | None = None,
    ui_port: int | None = None,
    ui_host: str = "127.0.0.1",
) -> None:
    """`muster broker`: with no NATS options, start an embedded nats-server first."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_state_dir(state_dir)
    holder = holder or _broker_identity(state_dir)
    embedded: EmbeddedNats | None = None
    if nats is None:
        embedded = EmbeddedNats(store_dir=state_dir / "nats", port=_preferred_port())
        await embedded.start()
        (state_dir / "nats.url").write_text(embedded.url + "\n")
        print(
            f"muster: embedded NATS at {embedded.url} (agents and clients: --nats {embedded.url})"
        )
        nats = NatsOptions(url=embedded.url)
        # One server holds one copy: more replicas could never be placed.
        config = msgspec.structs.replace(config, replication=Replication())
    nc = await connect(nats, "muster-broker")
    agent_nc = await connect(nats, "muster-broker-agents")
    broker = Broker(config, nc, holder=holder, pace_gc=True, agent_nc=agent_nc)
    if metrics_port is not None:
        broker.metrics.serve(metrics_port)
    health_port = healthz.port_from_env()
    health = await healthz.serve(health_port, lambda: nc.is_connected) if health_port else None
    dashboard = None
    if ui_port is not None:
        from broker.ui.server import start_dashboard

        dashboard = await start_dashboard(broker, ui_host, ui_port)
        print(f"muster: dashboard at {dashboard.url} (read-only; put it behind your auth)")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, broker.stopped.set)
    try:
        await broker.run()
    finally:
        if health is not None:
            health.close()
        if dashboard is not None:
            await dashboard.stop()
        for conn in (agent_nc, nc):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.drain(), 5)
        if embedded is not None:
            await embedded.stop()
            with contextlib.suppress(FileNotFoundError):
                (state_dir / "nats.url").unlink()
        lock.close()
