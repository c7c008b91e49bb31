from __future__ import annotations

import asyncio

from nats.aio.client import Client


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
