"""The broker as a process: the lease, leadership, standby, restore, start and stop.

A broker stands by (a hot mirror of the job bucket) until it holds the lease, restores the
machine from its records, serves while it leads, and steps down when leadership is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import secrets
import time
from typing import Any

import structlog
from nats.js import api
from nats.js.errors import NotFoundError

from broker.agentlink import AgentMailboxes
from broker.core.effects import Send
from broker.core.inputs import Restore
from broker.core.machine import Machine
from broker.core.records import RECORD_FORMAT
from broker.fields import BrokerFields
from broker.intake import ensure_intake, intake_names
from broker.lease import LeadershipLost, highest_epoch, record_epoch
from broker.snapshot import written_seq
from broker.snapshotwriter import SnapshotJob, Snapshots
from broker.store import (
    BucketWatch,
    JobStore,
    NewerRecords,
    RecordMirror,
    placement_of,
    reconcile_replication,
)
from schemas.agent import Dispatch
from schemas.subjects import snapshot_bucket_of
from shell.natsio import flush
from shell.tasks import cancel_and_wait

log = structlog.get_logger("muster.broker")

RESTORE_LIMIT_S = 60.0  # the longest a new leader waits for its records
STANDBY_RETRY_S = 0.5  # pause after a failed attempt to acquire the lease
NEWER_RECORDS_RETRY_S = 10.0  # lease left to a newer broker this long before trying again
BUCKET_CHECK_S = 1.0  # how often the leader checks the job bucket still holds its records
SNAPSHOT_ASK_S = 5.0  # how long a new leader asks for the newest snapshot's description
SNAPSHOT_CHECK_S = 1.0  # how often the leader asks whether a snapshot of its records is due
HANDOVER_DRAIN_S = 2.0  # the longest a clean stop waits for its last writes
ID_KEY = "muster-id-key"  # submit-stream metadata: the secret behind server-derived job ids


def machine_resync(machine: Machine) -> Any:
    from schemas.agent import Resync

    return Resync(epoch=machine.epoch, reason="new leader")


class BrokerProcess(BrokerFields):
    """Lease, leadership, standby and restore: when this broker serves, and how it starts."""

    async def run(self) -> None:
        """Stand by until leading, serve, and go back to standby if leadership is lost.

        The standby is hot: a RecordMirror follows the job bucket while the lease is watched,
        so a takeover waits for the last few writes instead of reading every record. Each
        standby round starts a fresh mirror; a broker that leads at once (`_won_at_once`)
        pays a full read, after the lease is won."""
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
            assert self.store is not None  # opened by _ensure_streams
            mirror = self.mirror = RecordMirror(self.store)
            try:
                if not await self._won_at_once():
                    await self._start_mirror(mirror)
                    if not await self._stand_by_reading(mirror):
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

    async def _won_at_once(self) -> bool:
        """Try the lease once before mirroring: a broker restarted with its own identity, or
        the first one, leads at once and reads its records after, with nothing else running.
        A mirror started first floods the event loop with 100,000 records while the lease is
        asked for; the lease's own requests then came too late, the broker took its own
        lease for another's and waited a whole TTL for it (9 s of a 13 s restart)."""
        try:
            won = await self.lease.try_acquire()
        except Exception as exc:  # NATS away: stand by, which retries
            log.warning("lease.acquire_failed", error=str(exc))
            return False
        if won:
            log.info("lease.acquired", holder=self.lease.holder, epoch=self.lease.epoch)
        return won

    @staticmethod
    async def _start_mirror(mirror: RecordMirror) -> None:
        try:
            await mirror.start()
        except Exception as exc:  # NATS away: the mirror starts when the lease is won
            log.warning("broker.mirror_not_started", error=str(exc))

    async def _stand_by_reading(self, mirror: RecordMirror) -> bool:
        """Stand by (`_stand_by`) with the cycle collector paused while the mirror reads the
        bucket the first time: it walked the records again and again as they were built, and
        the first read of 100,000 cost 2.3-3.2 CPU-s instead of 1.1. Once read, they are
        frozen (never walked by a collection again) and the collector runs again."""
        collecting = gc.isenabled()
        gc.disable()

        async def first_read() -> None:
            with contextlib.suppress(Exception):
                await mirror.caught_up(RESTORE_LIMIT_S)
            gc.freeze()
            if collecting:
                gc.enable()

        reading = asyncio.create_task(first_read())
        try:
            return await self._stand_by()
        finally:
            await cancel_and_wait(reading)
            if collecting:
                gc.enable()

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
        machine = Machine(self.config, epoch=self.lease.epoch, dispatch_token=self._attempt_token)
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
            self.stats["restored_from_snapshot"] = mirror.snapshot_seq
            await mirror.stop()  # the leader does not mirror its own writes
            log.info(
                "broker.mirror_caught_up",
                records=len(records),
                stream_seq=stream_seq,
                snapshot_seq=self.stats["restored_from_snapshot"],
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
        sent = [e.command for e in resend if isinstance(e, Send)]
        dispatches = sum(isinstance(cmd, Dispatch) for cmd in sent)
        self.stats["redispatched"] += dispatches
        if resend:
            log.info(
                "broker.redispatching_unacknowledged",
                dispatches=dispatches,
                cancels=len(sent) - dispatches,
            )
            self._push(resend)
        self._tasks = [
            asyncio.create_task(self._pipeline()),
            asyncio.create_task(self._submissions()),
            asyncio.create_task(self._clock_loop()),
            asyncio.create_task(self._probe_storage()),
            asyncio.create_task(self._watch_bucket(machine)),
            asyncio.create_task(self._agent_worker()),
        ]
        if self.nats_options is not None:
            restored_from = self.stats["restored_from_snapshot"]
            self._tasks.append(asyncio.create_task(self._snapshot_records(restored_from)))
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
        if stop in done and not hold.done():
            await self._hand_over()

    async def _hand_over(self) -> None:
        """A clean stop while leading: what was pushed so far runs and every deferred record
        is written before the lease is released, so the next leader restores this one's last
        word (an attempt found running, say) instead of what a crash would leave it. Bounded:
        a store that does not answer must not hold the stop up."""
        self._handing_over = True
        try:
            async with asyncio.timeout(HANDOVER_DRAIN_S):
                await self.drained()
        except TimeoutError:
            log.warning(
                "broker.handover_drain_timed_out",
                unwritten=self._unwritten + self._writes.waiting(),
            )

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

    async def _snapshot_records(self, restored_from: int) -> None:
        """Have the job bucket's snapshot written when enough was written since the last one
        (broker/snapshotwriter.py), so that a restart reads it and little else. A writer that
        fails is tried again after the gap; its writes change nothing the broker holds."""
        assert self.store is not None and self.nats_options is not None
        limits = self.config.limits
        snapshots = self.snapshots = Snapshots(
            SnapshotJob(
                nats=self.nats_options,
                bucket=self.store.bucket,
                replication=self.config.replication,
                max_bytes=limits.snapshot_bucket_max_bytes,
            ),
            after_writes=limits.records_snapshot_after_writes,
            gap_s=limits.records_snapshot_gap_s,
            now=time.monotonic(),
            last_seq=restored_from,
        )
        # A standby that took over restored before the newest snapshot was written: the
        # snapshot's description says how recent it is, so the first one is not a repeat.
        bucket = snapshot_bucket_of(self.store.bucket)
        with contextlib.suppress(Exception):  # not answered: the next one may repeat the last
            info = await self.store.js.stream_info(self.store.stream)
            snapshots.learned(await written_seq(self.store.js, bucket, info, SNAPSHOT_ASK_S))
        while True:
            await asyncio.sleep(SNAPSHOT_CHECK_S)
            if snapshots.due(self.store.acked_seq, time.monotonic()):
                await snapshots.write(time.monotonic())

    async def _step_down(self) -> None:
        self.leading.clear()
        self.snapshots = None
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        await cancel_and_wait(*self._tasks, *self._background)
        self._drop_first_copies()
        self._tasks = []
        self._background = set()
        self._queue = asyncio.Queue()
        self._sequencer.reset()
        self._writes.reset()  # deferred records die with the leadership, as in a crash
        self._unwritten = 0  # and so does the put the pipeline was retrying
        self._writes_wake = None
        self._handing_over = False
        self.machine = None

    async def _lose_leadership(self, why: str) -> None:
        self.leading.clear()
        for task in self._tasks:
            task.cancel()
        log.error("broker.fenced", why=why)
