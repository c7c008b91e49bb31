"""A dead leader is found by its dropped subscription, not by waiting out its lease
(broker/liveness.py): `kill -9` of a real broker process hands over to a standby before the
lease could expire, while a stopped (SIGSTOP) or CPU-starved leader, which keeps its
subscription, is never taken for dead."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest
from nats.aio.client import Client

from broker.lease import LeaderLease
from broker.liveness import Alive, LivenessAnswer
from broker.service import Broker
from load.common import BrokerProcess
from tests.broker.conftest import Harness, StartBroker, broker_config
from tests.broker.jobs import job
from tests.handover import kill9_hands_over, probed
from tests.support import wait_for

TTL_S = 8.0  # a probe decides after half of it; the lease expires only after all of it


async def watching(harness: Harness, brokers: StartBroker) -> Broker:
    """An in-process standby (its probes can be read) that has seen the leader renew."""
    broker = await brokers(config=broker_config(harness.prefix, lease_ttl_s=TTL_S))
    await wait_for(lambda: broker.lease.renewals_seen >= 1, 30, what="the standby's watch")
    return broker


@pytest.fixture
def leader_process(harness: Harness) -> Iterator[BrokerProcess]:
    """The leader as a real process (it is killed and stopped with signals)."""
    process = BrokerProcess(harness.url, broker_config(harness.prefix, lease_ttl_s=TTL_S))
    process.start()
    try:
        yield process
    finally:
        if process.proc is not None and process.proc.poll() is None:
            process.proc.send_signal(signal.SIGCONT)
        process.cleanup()


async def test_kill9_of_the_leader_hands_over_before_the_lease_expires(
    harness: Harness, leader_process: BrokerProcess, brokers: StartBroker
) -> None:
    epoch = (await leader_process.wait_leading(harness.nc))["epoch"]
    broker = await watching(harness, brokers)
    await probed(broker, 3, 10)
    await kill9_hands_over(leader_process, broker, epoch, TTL_S)
    assert broker.snapshot_stats()["lease_taken_from_dead"] == 1


async def test_a_leader_stopped_for_less_than_the_ttl_keeps_the_lease(
    harness: Harness, leader_process: BrokerProcess, brokers: StartBroker
) -> None:
    """SIGSTOP for longer than the probe's half-TTL but less than the TTL: the stopped leader
    still holds its subscription, so probes time out and are never "no responders"."""
    epoch = (await leader_process.wait_leading(harness.nc))["epoch"]
    broker = await watching(harness, brokers)
    death = await probed(broker, 3, 10)
    assert leader_process.proc is not None
    leader_process.proc.send_signal(signal.SIGSTOP)
    try:
        await wait_for(
            lambda: death.quiet_for() > death.quiet_s + 0.5 and death.timeouts >= 3,
            TTL_S,
            what="the standby quiet past its threshold, probing a stopped leader",
        )
    finally:
        leader_process.proc.send_signal(signal.SIGCONT)
    stats = await leader_process.stats(harness.nc, timeout=10)
    assert stats["epoch"] == epoch and not broker.leading.is_set()
    assert death.no_responders == 0 and broker.lease.taken_from_dead == 0
    await wait_for(lambda: death.quiet_for() < 1.0, TTL_S, what="the leader renewing again")
    assert (await leader_process.stats(harness.nc))["epoch"] == epoch


@pytest.mark.usefixtures("two_burners")
async def test_a_leader_starved_of_cpu_is_not_taken_for_dead(
    harness: Harness, leader_process: BrokerProcess, brokers: StartBroker
) -> None:
    """Two CPU burners beside a leader taking submissions, for eight renewals seen."""
    epoch = (await leader_process.wait_leading(harness.nc))["epoch"]
    broker = await watching(harness, brokers)
    death = broker.lease.death
    assert death is not None, "the broker's lease has no liveness probe"
    seen = broker.lease.renewals_seen
    for i in range(200):
        reply = await harness.submit(job(f"load-{i}"))
        assert reply.accepted, reply
    await wait_for(lambda: broker.lease.renewals_seen >= seen + 8, 8 * TTL_S, what="eight renewals")
    assert death.probes > 0 and death.no_responders == 0
    assert broker.lease.taken_from_dead == 0 and not broker.leading.is_set()
    assert (await leader_process.stats(harness.nc))["epoch"] == epoch


async def test_a_renewing_leader_nobody_answers_for_is_not_taken(nc: Client) -> None:
    """ "No responders" alone is not enough: a leader whose subscription the standby's server
    stops seeing (a route between NATS servers re-forming) but whose renewals arrive keeps the
    lease. Here it answers at first, then its subscription goes, and it renews on."""
    js = nc.jetstream()
    bucket = f"LEASE_{os.urandom(4).hex()}"
    subject = f"_{bucket}.alive"
    # Renewals a second apart: runs of "no responders" long enough to count fit between them.
    leader = LeaderLease(js, bucket, "leader", ttl=4.0)
    assert await leader.try_acquire()
    answer = LivenessAnswer(nc, subject, lambda: Alive(holder="leader", epoch=leader.epoch))
    await answer.start()
    other = LeaderLease(js, bucket, "standby", ttl=4.0, nc=nc, alive_subject=subject)
    death = other.death
    assert death is not None
    holding = asyncio.create_task(leader.hold())
    taking = asyncio.create_task(other.acquire())
    try:
        await wait_for(lambda: death.probes >= 3, 10, what="probes answered by the leader")
        await answer.stop()  # the standby no longer sees it; it renews on
        seen = other.renewals_seen
        await wait_for(lambda: other.renewals_seen >= seen + 8, 30, what="two TTLs of renewals")
        assert death.no_responders >= 10
        assert not taking.done() and other.taken_from_dead == 0
        holding.cancel()  # now it dies: no renewal, and still nobody answers
        await asyncio.gather(holding, return_exceptions=True)
        epoch = await asyncio.wait_for(taking, 10)
    finally:
        holding.cancel()
        taking.cancel()
    assert epoch > leader.epoch and other.taken_from_dead == 1


async def test_a_leader_that_never_answered_is_left_to_expire(nc: Client) -> None:
    """A leader of an earlier release answers no probes: its standby takes over only once the
    lease expires, however long "no responders" has lasted (a late renewal of such a leader
    must not read as its death)."""
    js = nc.jetstream()
    bucket = f"LEASE_{os.urandom(4).hex()}"
    leader = LeaderLease(js, bucket, "leader", ttl=1.0)  # no liveness subject: answers nothing
    assert await leader.try_acquire()
    other = LeaderLease(js, bucket, "standby", ttl=1.0, nc=nc, alive_subject=f"_{bucket}.alive")
    epoch = await asyncio.wait_for(other.acquire(), 10)
    assert epoch > leader.epoch and other.taken_from_dead == 0
    assert other.death is not None and other.death.no_responders >= 3
