"""The leader lease in NATS KV: one holder at a time, epochs only grow, expiry hands over, and
a broker restarted with its own identity takes its lease back at once."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest
import structlog
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoStreamResponseError

from broker.lease import LeaderLease, LeadershipLost, LeaseHolder
from tests.support import wait_for


def _bucket() -> str:
    return f"LEASE_{uuid.uuid4().hex[:8]}"


async def test_one_holder_and_growing_epochs(nc: Client) -> None:
    js = nc.jetstream()
    bucket = _bucket()
    a = LeaderLease(js, bucket, "a", ttl=1.0)
    b = LeaderLease(js, bucket, "b", ttl=1.0)
    assert await a.try_acquire()
    assert not await b.try_acquire()
    assert await a.current() == "a"
    await a.renew()
    # a dies (stops renewing): b takes over after the TTL, with a higher epoch.
    epoch_b = await asyncio.wait_for(b.acquire(poll_s=0.1), 10)
    assert epoch_b > a.epoch
    assert await b.current() == "b"


async def test_restart_with_same_identity_reclaims_at_once(nc: Client) -> None:
    js = nc.jetstream()
    bucket = _bucket()
    first = LeaderLease(js, bucket, "broker-1", ttl=30.0)
    assert await first.try_acquire()
    restarted = LeaderLease(js, bucket, "broker-1", ttl=30.0)  # same state dir, new process
    assert await restarted.try_acquire()
    assert restarted.epoch > first.epoch
    other = LeaderLease(js, bucket, "broker-2", ttl=30.0)
    assert not await other.try_acquire()
    # The old incarnation can no longer renew: it has been fenced.
    try:
        await first.renew()
    except Exception as exc:
        assert "another broker" in str(exc)
    else:
        raise AssertionError("the old incarnation renewed a lease it no longer holds")


async def test_a_renewal_whose_ack_was_lost_keeps_the_lease(nc: Client) -> None:
    """NATS applied a renewal but the leader never saw the ack (a restart in between): its
    revision is stale, yet the lease is still its own. It must not step down."""
    js = nc.jetstream()
    bucket = _bucket()
    lease = LeaderLease(js, bucket, "broker-1", ttl=30.0)
    assert await lease.try_acquire()
    await lease.renew()
    kv = await js.key_value(bucket)
    entry = await kv.get("leader")
    assert entry.value is not None
    await kv.update("leader", entry.value, last=entry.revision)  # the "lost" renewal
    await lease.renew()  # would raise LeadershipLost without the recovery
    assert await lease.current() == "broker-1"
    # Someone else's write is not mistaken for ours.
    entry = await kv.get("leader")
    await kv.update(
        "leader", msgspec.json.encode(LeaseHolder("broker-2", 0.0, 99)), last=entry.revision
    )
    with pytest.raises(LeadershipLost):
        await lease.renew()
    assert await lease.current() == "broker-2"


async def _expired(js: JetStreamContext, bucket: str) -> None:
    """Wait until the server has aged the lease key out of its bucket."""
    kv = await js.key_value(bucket)

    async def gone() -> bool:
        try:
            await kv.get("leader")
        except KeyNotFoundError:
            return True
        return False

    await wait_for(gone, 30, what="the lease key aged out", interval=0.05)


async def _expired_then_taken(js: JetStreamContext, bucket: str) -> tuple[LeaderLease, LeaderLease]:
    """broker-1 leads, its key ages out, and broker-2 takes the lease while it is gone."""
    lease = LeaderLease(js, bucket, "broker-1", ttl=1.0)
    assert await lease.try_acquire()
    await asyncio.wait_for(_expired(js, bucket), 10)
    other = LeaderLease(js, bucket, "broker-2", ttl=1.0)
    assert await other.try_acquire()
    return lease, other


async def test_a_late_renewal_recreates_its_expired_key_and_keeps_the_epoch(nc: Client) -> None:
    """A renewal delayed past the TTL (a starved event loop) finds the key aged out. Nobody
    wrote it in between, so nobody led: the leader keeps leading with the same epoch."""
    js = nc.jetstream()
    bucket = _bucket()
    lease = LeaderLease(js, bucket, "broker-1", ttl=1.0)
    assert await lease.try_acquire()
    await lease.renew()
    epoch = lease.epoch
    await asyncio.wait_for(_expired(js, bucket), 10)
    await lease.renew()  # raised LeadershipLost ("wrong last sequence: 0") before
    assert lease.epoch == epoch
    assert lease.recreated == 1
    kv = await js.key_value(bucket)
    entry = await kv.get("leader")
    assert entry.value is not None
    held = msgspec.json.decode(entry.value, type=LeaseHolder)
    assert (held.holder, held.epoch) == ("broker-1", epoch)
    # A standby still cannot take it, and the next renewal is an ordinary one.
    assert not await LeaderLease(js, bucket, "broker-2", ttl=1.0).try_acquire()
    await lease.renew()
    assert lease.recreated == 1


async def test_a_late_renewal_steps_down_when_another_broker_led_meanwhile(nc: Client) -> None:
    """While the key was gone a standby won it (a higher epoch) and released it again. The
    late leader must not lead on with state that broker may have changed."""
    js = nc.jetstream()
    bucket = _bucket()
    lease, other = await _expired_then_taken(js, bucket)
    assert other.epoch > lease.epoch
    await other.release()  # a delete marker: the key is gone, but not by expiry
    with pytest.raises(LeadershipLost):
        await lease.renew()


async def test_a_late_renewal_steps_down_when_a_newer_lease_also_expired(nc: Client) -> None:
    """A standby led and its own key aged out as well: the key is absent again, but the
    recreated revision shows the gap, so the late leader steps down."""
    js = nc.jetstream()
    bucket = _bucket()
    lease, other = await _expired_then_taken(js, bucket)
    await asyncio.wait_for(_expired(js, bucket), 10)
    with pytest.raises(LeadershipLost):
        await lease.renew()
    assert lease.recreated == 0
    # It stepped down holding the key: a standby round of its own takes it back, at a new
    # epoch above the other broker's.
    assert await lease.try_acquire()
    assert lease.epoch > other.epoch


async def test_a_lease_bucket_lost_with_its_server_is_taken_back_by_its_leader(nc: Client) -> None:
    """An R1 server came back without its store: the lease bucket is empty and its sequence
    starts again at 1. The leader's write is the first since, so nobody else led: it keeps
    leading with its epoch. Any write before it would show as a gap and make it step down."""
    js = nc.jetstream()
    bucket = _bucket()
    lease = LeaderLease(js, bucket, "broker-1", ttl=30.0)
    assert await lease.try_acquire()
    for _ in range(3):
        await lease.renew()
    epoch = lease.epoch

    async def lose_bucket() -> None:
        await js.delete_key_value(bucket)
        await js.create_key_value(bucket=bucket, history=1, ttl=30.0)

    async def renewed() -> bool:
        """A renewal, tried again while the new bucket's stream does not answer yet, as the
        broker's renewal loop tries again for a TTL."""
        try:
            await lease.renew()
        except NoStreamResponseError:
            return False
        return True

    await lose_bucket()
    await wait_for(renewed, 10, what="a renewal on the new bucket")
    assert (lease.epoch, lease.recreated) == (epoch, 1)
    assert await lease.current() == "broker-1"
    for _ in range(3):
        await lease.renew()  # and the next renewals are ordinary ones

    # Lost again, and this time another broker wrote the key first (then released it). Its
    # first try may find the new bucket's stream not answering yet (`lease.create_failed`);
    # a standby tries again, and so does this one.
    await lose_bucket()
    other = LeaderLease(js, bucket, "broker-2", ttl=30.0)
    await wait_for(other.try_acquire, 10, what="broker-2 leading on the new bucket")
    await other.release()
    with pytest.raises(LeadershipLost):
        await lease.renew()


async def _leader_and_standby(nc: Client, ttl: float) -> tuple[LeaderLease, LeaderLease]:
    js = nc.jetstream()
    bucket = _bucket()
    leader = LeaderLease(js, bucket, "leader", ttl=ttl)
    assert await leader.try_acquire()
    return leader, LeaderLease(js, bucket, "standby", ttl=ttl)


async def test_a_standby_takes_a_released_lease_at_once(nc: Client) -> None:
    """A leader that exits cleanly deletes its key; the standby sees the delete on its watch
    and leads at once, long before the TTL (two minutes here) would have let it."""
    leader, standby = await _leader_and_standby(nc, ttl=120.0)
    taking = asyncio.create_task(standby.acquire())
    try:
        await wait_for(lambda: standby.renewals_seen >= 1, 10, what="the standby's watch")
        await leader.release()
        epoch = await asyncio.wait_for(taking, 10)
    finally:
        taking.cancel()
    assert epoch > leader.epoch and await standby.current() == "standby"
    assert standby.deletes_seen == 1 and standby.attempts == 2, "it tried once, then at the delete"


async def test_a_standby_watches_renewals_and_takes_over_only_after_expiry(nc: Client) -> None:
    """While the leader renews, the standby only watches (one try, when it started); when the
    renewals stop, it takes over once the key has expired, not before."""
    leader, standby = await _leader_and_standby(nc, ttl=1.0)
    holding = asyncio.create_task(leader.hold())
    taking = asyncio.create_task(standby.acquire())
    try:
        # Eight renewals are two TTLs: a polling standby would have tried about ten times.
        await wait_for(lambda: standby.renewals_seen >= 8, 20, what="renewals seen by the watch")
        assert standby.attempts == 1 and not taking.done()
        holding.cancel()  # the leader dies: no renewal, no release
        await asyncio.gather(holding, return_exceptions=True)
        epoch = await asyncio.wait_for(taking, 10)
    finally:
        holding.cancel()
        taking.cancel()
    assert epoch > leader.epoch and await standby.current() == "standby"
    assert standby.deletes_seen == 0


async def test_a_create_refused_for_anything_but_a_holder_is_logged_and_not_taken(
    nc: Client,
) -> None:
    """A standby's create that found the key held says nothing (that is what standing by
    means); one that nobody answered (the bucket's stream is gone) leads to nothing either,
    but says what it met, so a standby that never takes a free lease can be told apart."""
    js = nc.jetstream()
    bucket = _bucket()
    leader = LeaderLease(js, bucket, "leader", ttl=30.0)
    standby = LeaderLease(js, bucket, "standby", ttl=30.0)
    assert await leader.try_acquire()
    with structlog.testing.capture_logs() as logs:
        assert not await standby.try_acquire()  # held
        assert [e for e in logs if e["event"] == "lease.create_failed"] == []
        await js.delete_key_value(bucket)  # both opened it: their handles outlive the stream
        assert not await standby.try_acquire()
    failed = [e for e in logs if e["event"] == "lease.create_failed"]
    assert len(failed) == 1 and failed[0]["holder"] == "standby", logs
    assert "NoStreamResponse" in failed[0]["error"], failed[0]  # no stream took the write
