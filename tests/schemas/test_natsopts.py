"""`schemas.natsopts.flush`: after it returns, the server has every subscription made before."""

from __future__ import annotations

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from schemas.natsopts import NatsOptions, flush
from tests.support import wait_for


async def test_subscription_is_live_once_flushed(nats_url: str, nc: Client) -> None:
    """A fresh subscription on one connection, then a publish from another: with nats-py's own
    flush this loses about one message in ten; every one must arrive."""
    other = await nats.connect(nats_url)
    got: list[str] = []

    async def record(msg: Msg) -> None:
        got.append(msg.subject)

    try:
        for i in range(100):
            sub = await nc.subscribe(f"flushcheck.{i}", cb=record)
            await flush(nc)
            await other.publish(f"flushcheck.{i}", b"x")
            await flush(other)
            await wait_for(lambda i=i: len(got) > i, 5)  # type: ignore[misc]
            await sub.unsubscribe()
        assert got == [f"flushcheck.{i}" for i in range(100)]
    finally:
        await other.close()


def test_connect_kwargs_split_servers() -> None:
    kwargs = NatsOptions(url="nats://127.0.0.1:1, nats://127.0.0.1:2", user="u").connect_kwargs()
    assert kwargs["servers"] == ["nats://127.0.0.1:1", "nats://127.0.0.1:2"]
    assert kwargs["user"] == "u" and "tls" not in kwargs
