"""Brokers standing by beside a leader, and the steps of a handover that tests on one server
and on a three-server cluster share: an in-process broker started and stopped, its liveness
probes answered by the live leader, and `kill -9` of the leader's process found by those
probes before the lease could expire."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats

from broker.liveness import DeathWatch
from broker.service import Broker
from load.common import BrokerProcess
from schemas.config import BrokerConfig
from tests.support import wait_for


@contextlib.asynccontextmanager
async def in_process(config: BrokerConfig, url: str, holder: str) -> AsyncIterator[Broker]:
    """A broker running in this process on its own connection to `url`; stopped on exit."""
    broker = Broker(config, await nats.connect(url), holder=holder)
    task = asyncio.create_task(broker.run())
    try:
        yield broker
    finally:
        await broker.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15)
        await broker.nc.close()


async def probed(standby: Broker, probes: int, timeout: float) -> DeathWatch:
    """The standby's liveness probe once the live leader answered `probes` of them, none
    answered by "no responders"."""
    death = standby.lease.death
    assert death is not None, "the broker's lease has no liveness probe"
    await wait_for(lambda: death.probes >= probes, timeout, what="probes answered by the leader")
    assert death.no_responders == 0, "a live leader was answered for by nobody"
    return death


async def kill9_hands_over(
    leader: BrokerProcess, standby: Broker, epoch: int, ttl_s: float
) -> None:
    """`kill -9` of the leader's process: the standby leads, at a higher epoch, having found
    the leader dead rather than waited out its lease."""
    leader.kill9()
    await asyncio.wait_for(standby.leading.wait(), 2 * ttl_s)
    assert standby.lease.taken_from_dead == 1, "the standby waited out the lease instead"
    assert standby.lease.epoch > epoch
