from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from load.natscluster import NatsCluster


async def test_real_nats_with_jetstream(nc: Client) -> None:
    js = nc.jetstream()
    info = await js.account_info()
    assert info.limits is not None
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handler(msg) -> None:  # type: ignore[no-untyped-def]
        got.set_result(msg.data)

    sub = await nc.subscribe("fixture.check", cb=handler)
    await nc.publish("fixture.check", b"hello")
    assert await asyncio.wait_for(got, 5) == b"hello"
    await sub.unsubscribe()


async def test_a_cluster_that_does_not_come_up_says_what_each_member_did() -> None:
    """A three-server cluster whose members cannot form (here one alone, its peers never
    started) fails its readiness with each member's state and the last lines of its log,
    which a test's error then shows."""
    cluster = NatsCluster()
    try:
        cluster.start("n0")
        with pytest.raises(AssertionError) as failed:
            await cluster.ready(timeout=2.0)
        told = str(failed.value)
        assert "n0 running=True" in told and "n1 running=False" in told, told
        n0_log = told.split("; n1 ")[0].split("log: ", 1)[1]
        assert "[INF]" in n0_log or "[WRN]" in n0_log, told  # the member's own lines
    finally:
        cluster.cleanup()
