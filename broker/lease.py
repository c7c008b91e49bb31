"""Leader election through a lease in NATS KV.

The leader holds key `leader` in a bucket whose entries expire after the lease TTL and renews
it well before. The key's revision when acquired is the leader's epoch: JetStream sequences only
grow, so a later leader always has a higher epoch and agents can refuse the older one.

A renewal can still come late (a long synchronous restore, a starved event loop) and find the
key aged out. The leader then recreates it, keeping its epoch, but only when the recreated
revision directly follows its own last one: then no other broker wrote the key in between, so
none led, and the epoch agents fence on is still the newest ever issued. Any gap in the
revisions means another broker may have led, and the leader steps down. Revision 1 is no gap:
it is the first write to a bucket that was lost with its server, so ours is the first since.

A full JetStream server store refuses every write to a file-backed stream, the lease bucket's
included (nats-server checks the server's total use, not the stream's reservation). No other
broker can take the lease then either, so instead of stepping down the leader suspends: it
stops writing and sending (`proven` is cleared) but keeps serving, refusing submissions with
"storage full", and resumes once a renewal lands under the same conditions as above (its own
key, or a recreation right after its own revision).

The same holds while the lease bucket has no JetStream leader (a NATS server died and its Raft
group is electing, 4-9 s): the server answers "no responders" to every broker alike, so the
leader suspends rather than stepping down and restoring, and resumes with the same epoch once a
renewal lands under the same conditions.

An R1 lease bucket lost with its server comes back empty, and its revisions start at 1 again:
a new leader's revision would then be below the epoch agents have already seen, and they
would refuse it. So every leader records its epoch in the job bucket (`EPOCH_KEY`) before it
sends anything, and a leader whose revision is not above the recorded one takes the next
epoch instead (`fence_above`), carried in `LeaseHolder.epoch`. Agents see only the integer
in each command, as before: the wire is unchanged.

A standby does not poll the key: it watches it (`acquire`). A leader stopping cleanly deletes
the key (`release`, after it has stopped writing), and the standby, seeing the delete, takes it
at once. A leader that dies leaves the key to expire; the server removes it without a message
a watch could see, so the standby tries the key when a TTL has passed since the last renewal it
saw, and then after a hundredth of the TTL, twice as long each time up to a tenth of it (the
old poll), until the entry is gone or renewed.

A leader that died is found sooner, by its dropped subscription (broker/liveness.py): a
standby whose probes of the leader get "no responders" for 0.2 s, having seen no write of the
key for half a TTL and an answer from its holder before, takes the key with a
compare-and-set on the last revision it saw (`_take_from_dead`). Why this keeps the rules above:

- One holder, growing epochs. The compare-and-set succeeds only if nobody wrote the key since
  that revision, and its result is a new revision, so a new, higher epoch, as with a create.
  Two standbys racing for it: one write wins, the other's fails.
- A leader wrongly taken for dead (alive, but its subscription invisible to the standby's
  server for a moment: a reconnect, a route between servers re-forming) is the case the expiry
  path already has for a leader starved past its TTL: at its next renewal the revision is not
  its own (`renew` fails), `_recreate_expired` cannot apply (the key is live) and it steps
  down; meanwhile agents that saw the new epoch refuse its commands. What the takeover adds is
  only how early it can happen, and both guards bound that: "no responders" is the server's
  word that no subscription exists (a slow, starved or stopped leader still has one and is
  answered for late: a timeout, which starts the count over), and half a TTL without a
  renewal is two renewals missed, which a leader whose connection merely blinked does not
  miss (one renewal seen starts the count over). A leader that both misses two renewals and
  loses its subscription for that long is one the expiry path would also take over from,
  at most half a TTL later.
- A stopped leader (SIGSTOP) keeps its sockets, so its subscription: probes time out, and only
  the expiry path applies, as before.
- A renewal the standby has not read yet is no risk: the compare-and-set fails on it.
- The expiry and delete paths are unchanged. A leader of an earlier release answers no probes,
  so its standby never judges it by them (a late renewal of its would otherwise look like
  death): only a holder that has answered before can be found dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from typing import Annotated, Any

import msgspec
import structlog
from msgspec import Meta
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import (
    APIError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from broker.liveness import Alive, DeathWatch, LivenessAnswer
from broker.store import kv_stream_config, open_bucket
from schemas.config import Replication

log = structlog.get_logger("muster.lease")

KEY = "leader"
INSUFFICIENT_RESOURCES = 10023  # JetStream's err_code for a full server store
RENEWALS_PER_TTL = 4  # renew this often per TTL: three renewals can be late before expiry


class LeaseHolder(msgspec.Struct):
    holder: str
    acquired_at: float
    epoch: int = 0


EPOCH_KEY = "_epoch"  # in the job bucket; no job id starts with "_"


class EpochRecord(msgspec.Struct, frozen=True):
    """The highest epoch a leader has taken, kept where the lease bucket cannot lose it."""

    epoch: Annotated[int, Meta(ge=0)]
    holder: Annotated[str, Meta(max_length=512)] = ""


async def highest_epoch(js: JetStreamContext, jobs_bucket: str) -> int:
    """The highest epoch recorded in the job bucket, 0 when none is. Raises when the bucket
    cannot be read: a leader must not pick an epoch it cannot check."""
    try:
        msg = await js.get_last_msg(f"KV_{jobs_bucket}", f"$KV.{jobs_bucket}.{EPOCH_KEY}")
    except NotFoundError:
        return 0
    return epoch_of(msg.data)


def epoch_of(data: bytes | None) -> int:
    """The epoch an `_epoch` record holds; 0 for one that does not decode (logged): a damaged
    record must not keep every broker from leading."""
    if not data:
        return 0
    try:
        return msgspec.json.decode(data, type=EpochRecord).epoch
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.error("lease.epoch_record_unreadable", error=str(exc)[:200])
        return 0


async def record_epoch(js: JetStreamContext, jobs_bucket: str, epoch: int, holder: str) -> None:
    await js.publish(
        f"$KV.{jobs_bucket}.{EPOCH_KEY}",
        msgspec.json.encode(EpochRecord(epoch=epoch, holder=holder)),
    )


class LeadershipLost(RuntimeError):
    pass


class LeaderLease:
    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        holder: str,
        ttl: float,
        *,
        max_bytes: int = 64 * 1024,
        replication: Replication | None = None,
        nc: Client | None = None,
        alive_subject: str = "",
    ) -> None:
        self.js = js
        # Replicated like the job bucket: an R1 lease bucket on a lost server stops every
        # broker from leading, however many replicas the job records have.
        self.replication = replication or Replication()
        self.bucket = bucket
        self.holder = holder
        self.ttl = ttl
        self.epoch = 0
        self.max_bytes = max_bytes
        self.renew_failures = 0  # renewals that failed and were retried (a metric)
        self.recreated = 0  # late renewals that recreated the expired key (a metric)
        self.suspensions = 0  # times the lease could not be written by anyone (a metric)
        self.suspended_for = ""  # why the last suspension: "full" or "no-leader"
        self.attempts = 0  # tries to take the lease (a standby watching makes few)
        self.deletes_seen = 0  # releases a standby saw on its watch
        self.renewals_seen = 0  # writes of the key a standby saw on its watch
        # Set while the lease is known to be ours; cleared while suspended by a full store.
        # Writers wait on it: a leader that cannot prove its lease must not change state.
        self.proven = asyncio.Event()
        self._revision = 0
        self._kv: KeyValue | None = None
        # A dead leader found by its dropped subscription (broker/liveness.py), when given
        # a connection and the subject: the leader answers on it, a standby probes it.
        self._answer: LivenessAnswer | None = None
        self.death: DeathWatch | None = None  # a standby's probes (and their metrics)
        if nc is not None and alive_subject:
            self._answer = LivenessAnswer(nc, alive_subject, self._alive)
            self.death = DeathWatch(nc, alive_subject, ttl)
        self.taken_from_dead = 0  # leases taken from a leader found dead (a metric)
        self._dead_at = 0  # the revision a dead leader left, found by `_until_free`

    async def _open(self) -> KeyValue:
        if self._kv is None:
            # max_bytes reserves the bucket's space in the JetStream store up front, so other
            # streams filling the store can never stop a renewal.
            layout = kv_stream_config(
                self.bucket,
                self.replication,
                ttl=self.ttl,
                max_bytes=self.max_bytes,
                max_value_size=4096,
            )
            self._kv = await open_bucket(self.js, layout, self.replication)
        return self._kv

    async def try_acquire(self) -> bool:
        kv = await self._open()
        self.attempts += 1
        value = msgspec.json.encode(LeaseHolder(holder=self.holder, acquired_at=time.time()))
        revision: int | None
        try:
            revision = await kv.create(KEY, value)
        except KeyWrongLastSequenceError:  # held: by this identity's earlier process, or not
            revision = await self._reclaim_own(kv, value)
        except Exception as exc:  # unanswered or refused; it may have been written all the same
            log.warning(
                "lease.create_failed",
                holder=self.holder,
                error=repr(exc),
                why="the lease key could not be written; tried again later",
            )
            revision = await self._reclaim_own(kv, value)
        if revision is None:
            return False
        await self._won(revision)
        return True

    async def _won(self, revision: int) -> None:
        self._revision = revision
        self.epoch = revision
        self.proven.set()
        if self._answer is not None:
            await self._answer.start()

    def _alive(self) -> Alive:
        return Alive(holder=self.holder, epoch=self.epoch)

    def fence_above(self, highest: int) -> int:
        """Make this leadership's epoch higher than `highest`, the highest one ever recorded:
        a lease bucket that was lost restarts its revisions at 1. The next renewal writes it
        into the key (`LeaseHolder.epoch`), where other brokers read it."""
        if self.epoch <= highest:
            log.warning(
                "lease.epoch_raised",
                holder=self.holder,
                revision=self.epoch,
                recorded=highest,
                epoch=highest + 1,
                why="the lease bucket's revisions are behind an epoch already taken "
                "(the bucket was lost and recreated)",
            )
            self.epoch = highest + 1
        return self.epoch

    async def _reclaim_own(self, kv: KeyValue, value: bytes) -> int | None:
        """A broker restarted with the same identity (its state directory, held under an
        exclusive lock, so never two processes at once) takes its own lease back at once
        instead of waiting for it to expire. The new revision is a new, higher epoch."""
        try:
            entry = await kv.get(KEY)
            if entry.value is None or entry.revision is None:
                return None
            if msgspec.json.decode(entry.value, type=LeaseHolder).holder != self.holder:
                return None
            return await kv.update(KEY, value, last=entry.revision)
        except Exception:
            return None

    async def acquire(self, poll_s: float | None = None) -> int:
        """Block until this process leads; returns the epoch.

        The standby watches the lease key instead of polling it. A delete (the leader stepped
        down on a clean exit) is answered at once; each renewal it sees moves the first moment
        the key can expire (a TTL after the renewal was written) and the key is tried again
        only then, after `poll_s` and then twice as long each time (up to the old poll, a
        tenth of the TTL) until it is gone or renewed: the server removes an expired entry
        without a message a watch could see, and a watch that went quiet costs no more than
        polling did."""
        retry = poll_s if poll_s is not None else max(0.02, self.ttl / 100)
        longest = max(retry, 0.2, self.ttl / 10)
        announced = False
        watcher: Any = None
        wait = self.ttl  # until the watch delivers the key's current entry
        try:
            while not await self.try_acquire():
                if not announced:
                    log.info("lease.standby", holder=self.holder, current=await self.current())
                    announced = True
                if watcher is None:
                    watcher = await (await self._open()).watch(KEY)
                renewed = await self._until_free(watcher, wait)
                if await self._take_from_dead():
                    break
                wait = retry if renewed or wait >= self.ttl else min(longest, wait * 2)
        finally:
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.stop()
        log.info("lease.acquired", holder=self.holder, epoch=self.epoch)
        return self.epoch

    async def _until_free(self, watcher: Any, wait: float) -> bool:
        """Return when the key may be free: deleted, or no renewal seen for a TTL (or `wait`,
        whichever the last entry seen allows). True when a renewal was seen meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        renewed = False
        death = self.death
        self._dead_at = 0
        while (left := deadline - loop.time()) > 0:
            if death is not None:  # wake for the next probe; writes delivered are read first
                left = max(0.001, min(left, death.next_probe_in()))
            try:
                entry = await watcher.updates(timeout=left)
            except TimeoutError:  # nats' TimeoutError is one too
                if loop.time() >= deadline:
                    break
                entry = None
            if entry is None:
                # The watch has delivered everything there was, or is quiet: probe the leader
                # when due, never with a delivered write left unread.
                if death is not None and not death.next_probe_in():
                    self._dead_at = await death.probe()
                    if self._dead_at:
                        break
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                self.deletes_seen += 1
                if death is not None:
                    death.saw(0)
                break
            self.renewals_seen += 1
            renewed = True
            if death is not None:
                death.saw(entry.revision or 0, holder_of(entry.value))
            deadline = loop.time() + self._left_of(entry.created)
        return renewed

    async def _take_from_dead(self) -> bool:
        """Take the key from a leader found dead (broker/liveness.py), if nobody wrote it
        since the revision seen last: the compare-and-set fails otherwise."""
        revision, self._dead_at = self._dead_at, 0
        if not revision:
            return False
        kv = await self._open()
        self.attempts += 1
        value = msgspec.json.encode(LeaseHolder(holder=self.holder, acquired_at=time.time()))
        try:
            taken = await kv.update(KEY, value, last=revision)
        except Exception as exc:  # written since (alive after all), or NATS away
            log.info("lease.leader_not_taken", revision=revision, error=str(exc)[:200])
            return False
        self.taken_from_dead += 1
        log.warning("lease.taken_from_dead_leader", holder=self.holder, last=revision)
        await self._won(taken)
        return True

    def _left_of(self, created: datetime.datetime | None) -> float:
        """Seconds until an entry written at `created` (the server's clock) can expire: a TTL
        from now at most, so a clock behind the server's never makes a standby late."""
        if created is None:
            return self.ttl
        age = time.time() - created.timestamp()
        return min(self.ttl, max(0.0, self.ttl - age))

    async def renew(self) -> None:
        kv = await self._open()
        value = msgspec.json.encode(
            LeaseHolder(holder=self.holder, acquired_at=time.time(), epoch=self.epoch)
        )
        try:
            self._revision = await kv.update(KEY, value, last=self._revision)
        except KeyWrongLastSequenceError as exc:
            if await self._renewed_unacknowledged(kv):
                return
            if await self._recreate_expired(kv, value):
                return
            raise LeadershipLost(f"another broker holds the lease: {exc}") from exc

    async def _recreate_expired(self, kv: KeyValue, value: bytes) -> bool:
        """The key aged out before a late renewal reached it. Recreate it (only if absent:
        `last=0` fails on any live entry or delete marker) and keep leading only if its new
        revision is the next one after ours, i.e. nobody wrote the key while it was gone."""
        try:
            revision = await kv.update(KEY, value, last=0)
        except KeyWrongLastSequenceError:
            return False  # another broker holds it, or released it: it led after us
        if revision == 1 and self._revision > 1:
            # Revision 1 is the first message of a new stream: the bucket itself was lost (an
            # R1 server came back without its store) and ours is the first write since, so no
            # other broker led in between. Keep leading: our records are the ones to write back.
            self.recreated += 1
            log.warning(
                "lease.bucket_lost", holder=self.holder, epoch=self.epoch, last=self._revision
            )
            self._revision = revision
            return True
        if revision != self._revision + 1:
            # We hold the key again but someone wrote it in between; our state may be stale.
            # Keep the key (a standby round reclaims its own lease at once) and step down.
            log.warning(
                "lease.recreated_after_gap",
                holder=self.holder,
                epoch=self.epoch,
                last=self._revision,
                revision=revision,
            )
            self._revision = revision
            raise LeadershipLost(
                f"the lease expired and another broker wrote it (revision {revision})"
            )
        self.recreated += 1
        log.warning("lease.recreated", holder=self.holder, epoch=self.epoch, revision=revision)
        self._revision = revision
        return True

    async def _renewed_unacknowledged(self, kv: KeyValue) -> bool:
        """A renewal the server applied but whose ack was lost (a NATS restart in between)
        leaves our revision stale, though the lease is still ours: same holder, same epoch.
        Adopt its revision instead of stepping down for nothing."""
        try:
            entry = await kv.get(KEY)
            if entry.value is None or entry.revision is None:
                return False
            held = msgspec.json.decode(entry.value, type=LeaseHolder)
        except Exception:
            return False
        if held.holder != self.holder or held.epoch != self.epoch:
            return False
        log.info("lease.renewal_recovered", holder=self.holder, epoch=self.epoch)
        self._revision = entry.revision
        return True

    async def hold(self) -> None:
        """Renew until another broker holds the lease; raises LeadershipLost. Any other error
        (NATS away, a timeout) is retried with backoff for as long as the lease can still be
        ours: until a TTL has passed since the last renewal. "Insufficient resources" (a full
        server store) suspends the lease instead, for as long as it lasts."""
        try:
            await self._hold()
        finally:
            if self._answer is not None:
                await self._answer.stop()

    async def _hold(self) -> None:
        interval = self.ttl / RENEWALS_PER_TTL
        last_ok = time.monotonic()
        delay = interval
        while True:
            await asyncio.sleep(delay)
            late = time.monotonic() - last_ok
            if late > self.ttl / 2 and self.proven.is_set():
                log.warning("lease.renew_late", since_last_s=round(late, 2), ttl_s=self.ttl)
            try:
                await self.renew()
                last_ok = time.monotonic()
                delay = interval
            except LeadershipLost:
                raise
            except Exception as exc:
                self.renew_failures += 1
                left = self.ttl - (time.monotonic() - last_ok)
                if store_refused(exc) or no_stream_leader(exc):
                    # Writes fail now anyway: stop them at once, before the key can expire.
                    self._suspend(exc)
                    delay = interval
                elif left > 0:
                    log.warning("lease.renew_retry", error=str(exc), left_s=round(left, 2))
                    delay = min(interval, max(0.05, left / 4))
                else:
                    raise LeadershipLost(
                        f"could not renew the lease for {self.ttl:g}s: {exc}"
                    ) from exc
            else:
                if not self.proven.is_set():
                    log.warning("lease.resumed", holder=self.holder, epoch=self.epoch)
                    self.proven.set()

    def _suspend(self, exc: Exception) -> None:
        if self.proven.is_set():
            self.suspensions += 1
            self.suspended_for = "full" if store_refused(exc) else "no-leader"
            log.error(
                "lease.suspended",
                holder=self.holder,
                epoch=self.epoch,
                error=str(exc),
                why="the JetStream server store is full: no broker can write the lease"
                if self.suspended_for == "full"
                else "the lease bucket has no JetStream leader (a NATS server failover): "
                "no broker can write the lease until one is elected",
            )
            self.proven.clear()

    async def confirm_newer(self, epoch: int) -> bool:
        """True when the lease proves a leader newer than us: another holder, or an epoch
        above ours. An agent's word alone never makes a leader step down."""
        held = await self._held()
        return held is not None and (held.holder != self.holder or held.epoch > epoch)

    async def _held(self) -> LeaseHolder | None:
        kv = await self._open()
        try:
            entry = await kv.get(KEY)
        except Exception:
            return None
        if entry.value is None:
            return None
        return msgspec.json.decode(entry.value, type=LeaseHolder)

    async def release(self) -> None:
        """Delete the key if it is still ours. A broker that never led has no revision, and
        a delete without one (`last=0`) is unconditional in nats-py: a standby shutting down
        deleted the leader's lease, another broker took it, and the old leader acknowledged
        submissions the new one never saw until its next renewal."""
        if self._answer is not None:
            await self._answer.stop()
        if self._revision <= 0:
            return
        kv = await self._open()
        with contextlib.suppress(Exception):
            await kv.delete(KEY, last=self._revision)

    async def current(self) -> str | None:
        held = await self._held()
        return None if held is None else held.holder

    @property
    def revision(self) -> int:
        """The key's revision at this holder's last write (each renewal adds one; 0: none)."""
        return self._revision


def holder_of(value: bytes | None) -> str:
    """The holder a lease value names; "" for one that does not decode."""
    try:
        return msgspec.json.decode(value or b"", type=LeaseHolder).holder
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""


def no_stream_leader(exc: BaseException) -> bool:
    """True when the server answered that no stream takes the lease's subject (503, no
    responders): the bucket's Raft group has no leader, as during a NATS failover. Unlike a
    timeout (which may be our connection alone), this is the cluster's answer to everyone."""
    return isinstance(exc, NoStreamResponseError)


def store_refused(exc: BaseException) -> bool:
    """True for JetStream's "insufficient resources": the server store is full."""
    return isinstance(exc, APIError) and exc.err_code == INSUFFICIENT_RESOURCES
