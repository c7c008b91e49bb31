"""The broker's submission loop: from the stream to a persisted record and a reply.

Batches come from the per-queue consumers (`broker/intake.py`); each message is given an
attempt marker, goes to the dead-letter subject after too many attempts, and is acked and
answered only once its record is persisted. Kept apart from the consumers, which know nothing
of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import NamedTuple

import structlog
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError

from broker import intake, tenancy
from broker.attempts import AttemptMarkers
from broker.core.effects import Effect, Persist, split_reply
from broker.core.inputs import SubmitJob
from broker.core.machine import Machine
from broker.core.submission import derive_job_id
from broker.fields import BrokerFields
from broker.intake import FairPuller, intake_names, parse_submission, unknown_queue_error
from broker.rendezvous import RendezvousKey
from schemas.api import SubmitReply
from schemas.codec import DecodeError, encode_json
from schemas.job import JobSpec
from shell.natsio import js_api_prefix

log = structlog.get_logger("muster.broker")

FETCH_BATCH = 512
SUBMIT_INFLIGHT = 4  # fetched batches awaiting persistence at once
# A submission whose processing was attempted this many times without an ack (the broker died
# or failed while processing it) is not processed again: it goes to the dead-letter subject.
# Attempts are the first delivery and every redelivery whose attempt marker the job bucket
# took (broker/attempts.py): a redelivery while the store is away is put back uncounted.
MAX_DELIVERIES = 2
PUT_BACK_S = 2.0  # a redelivery whose attempt marker the store refused comes back after this
MAX_EXCUSED = 100_000  # excused stream sequences remembered (see Broker._hold_while_persisting)


def _ack_tokens(msg: Msg) -> tuple[int, int, int]:
    """(times delivered, stream sequence, stored-at ns) from a JetStream message's ack subject,
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` or the longer form
    with domain and account hash. A deliberate fast path of nats-py's `Msg.metadata` (which
    builds a dataclass and a datetime per message), with it as the fallback for any other
    form."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"]:
        if len(tokens) == 9:
            return int(tokens[4]), int(tokens[5]), int(tokens[7])
        if len(tokens) >= 11:
            return int(tokens[6]), int(tokens[7]), int(tokens[9])
    meta = msg.metadata
    return meta.num_delivered, meta.sequence.stream, int(meta.timestamp.timestamp() * 1e9)


class Delivery(NamedTuple):
    """A fetched message with its ack subject parsed once, when the batch arrives, rather
    than at each step that needs it (attempt markers, job ids, acks, dead letters).
    `delivered` is 0 when the ack subject could not be read: such a message counts as a
    first delivery with no stream sequence."""

    msg: Msg
    delivered: int
    seq: int
    stored_ns: int

    @classmethod
    def of(cls, msg: Msg) -> Delivery:
        try:
            return cls(msg, *_ack_tokens(msg))
        except Exception:
            return cls(msg, 0, 0, 0)


# A stored copy's answer: its delivery, the reply, whether to terminate it rather than ack
# it, and its rendezvous key when taking it made one.
Answer = tuple[Delivery, bytes, bool, RendezvousKey | None]


class SubmissionIntake(BrokerFields):
    """Takes submissions from the stream into the machine and answers them."""

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
            replies: list[Answer] = []
            machine = self.machine
            assert machine is not None
            effects: list[Effect] = []
            known = False  # a copy of a job already submitted, maybe not persisted yet
            batch = [Delivery.of(msg) for msg in msgs]
            taking = self._rendezvous.taking
            keys = [taking(d.msg.subject, d.msg.data, d.msg.headers) for d in batch]
            prior = await self._begin_attempts(batch)
            for i, d in enumerate(batch):
                attempts = prior.get(i, 0)
                if attempts < 0:
                    continue  # put back: the store is away
                more: list[Effect] = []
                if attempts >= MAX_DELIVERIES:
                    reply, term = await self._dead_letter_reply(d, attempts), True
                else:
                    reply, more, term = await self._submit_guarded(machine, d, limit)
                effects.extend(more)
                known = known or (reply.accepted and reply.duplicate)
                replies.append((d, encode_json(reply), term, keys[i]))
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
        replies: list[Answer],
        inflight: asyncio.Semaphore,
    ) -> None:
        try:
            if persisted is not None:
                await self._hold_while_persisting(persisted, [r[0] for r in replies])
            for d, payload, term, key in replies:
                msg = d.msg
                with contextlib.suppress(Exception):  # unacked: redelivered, then dead-lettered
                    await (msg.term() if term else msg.ack())
                    if d.delivered > 1 and self.store is not None:  # it may have a marker
                        await AttemptMarkers(self.store.js, self.store.bucket).clear(d.seq)
                # The original subject is the stream message's subject.
                await self._rendezvous.on_result(msg.subject, msg.data, msg.headers, payload, key)
        finally:
            inflight.release()

    async def _hold_while_persisting(
        self, persisted: asyncio.Future[None], batch: list[Delivery]
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
                for d in batch:
                    with contextlib.suppress(Exception):
                        await d.msg.in_progress()
            persisted.result()
        except asyncio.CancelledError:
            for d in batch:
                if d.delivered:  # its ack subject was read
                    self._excused[d.seq] = self._excused.get(d.seq, 0) + 1
            while len(self._excused) > MAX_EXCUSED:
                self._excused.popitem(last=False)
            raise

    async def _begin_attempts(self, batch: list[Delivery]) -> dict[int, int]:
        """For each redelivered message of a batch (by index), the processing attempts before
        this one that started with the store present, counting the first delivery (no marker
        is written for it: the hot path) and not the deliveries this process excused. -1: the
        store did not take the marker, so the message was put back (nak with a delay) and
        this delivery counts for nothing."""
        redelivered = [
            (i, d.msg, d.seq, d.stored_ns) for i, d in enumerate(batch) if d.delivered > 1
        ]
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

    async def _dead_letter_reply(self, d: Delivery, attempts: int) -> SubmitReply:
        """Move a submission that failed processing `attempts` times to the dead-letter
        subject; the reply says so (the message is then terminated, not processed)."""
        msg = d.msg
        queue = self.subjects.queue_of_submit_subject(msg.subject)
        error = (
            f"submission failed processing {attempts} times (stream sequence {d.seq}); "
            "moved to the dead-letter subject. Check the job against the docs and "
            "submit a corrected one"
        )
        await self._dead_letter(msg, queue, error)
        return SubmitReply(accepted=False, error=error)

    async def _submit_guarded(
        self, machine: Machine, d: Delivery, limit: int
    ) -> tuple[SubmitReply, list[Effect], bool]:
        """The submission boundary: whatever a message holds, it is answered (accepted or
        rejected with a reason) and acked; it never raises. Returns (reply, effects,
        terminate)."""
        msg, seq, stored_ns = d.msg, d.seq, d.stored_ns
        queue = self.subjects.queue_of_submit_subject(msg.subject)
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
        error = unknown_queue_error(self.config, self._intake_names, queue)
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
