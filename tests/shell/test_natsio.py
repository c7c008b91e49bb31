"""The nats-py shims (shell/natsio.py): the versions whose private attributes they use, the
ordered flush, the shared-inbox requester and the JetStream accessors, against a real server."""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from shell.natsio import (
    NATS_PY_TESTED,
    Requester,
    deliver_inline,
    flush,
    js_api_prefix,
    js_connection,
)
from tests.support import wait_for


def test_nats_py_is_a_tested_version(nc: Client) -> None:
    """The shims read nats-py private attributes; a release not listed in NATS_PY_TESTED must
    be checked (this file's tests) and added there and to pyproject.toml's range."""
    installed = version("nats-py")
    minor = ".".join(installed.split(".")[:2])
    assert minor in NATS_PY_TESTED, (
        f"nats-py {installed} is not one of the releases shell/natsio.py was checked against "
        f"({', '.join(NATS_PY_TESTED)}): run tests/shell/, then add it to NATS_PY_TESTED and "
        "to the nats-py range in pyproject.toml"
    )
    assert "force_flush" in inspect.signature(nc._flush_pending).parameters
    js = nc.jetstream()
    assert isinstance(js._prefix, str) and js._nc is nc


async def test_jetstream_accessors(nc: Client) -> None:
    js = nc.jetstream()
    assert js_api_prefix(js) == "$JS.API"
    assert js_connection(js) is nc
    assert js_api_prefix(nc.jetstream(domain="hub")) == "$JS.hub.API"


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
            await wait_for(lambda i=i: len(got) > i, 5, interval=0.001)
            await sub.unsubscribe()
        assert got == [f"flushcheck.{i}" for i in range(100)]
    finally:
        await other.close()


async def test_requester_matches_replies_to_requests(nats_url: str, nc: Client) -> None:
    """Replies come back out of order; each request gets its own."""
    other = await nats.connect(nats_url)
    held: list[Msg] = []

    async def echo_later(msg: Msg) -> None:
        held.append(msg)
        if len(held) == 3:
            for m in reversed(held):  # answer the last request first
                await m.respond(b"re:" + m.data)

    try:
        await other.subscribe("requester.echo", cb=echo_later)
        await flush(other)
        requester = Requester(nc)
        replies = await asyncio.gather(
            *(requester.request("requester.echo", f"{i}".encode(), timeout=5) for i in range(3))
        )
        assert [r.data for r in replies] == [b"re:0", b"re:1", b"re:2"]
    finally:
        await other.close()


async def test_requester_errors_are_nats_errors(nc: Client) -> None:
    requester = Requester(nc)
    with pytest.raises(NoRespondersError):
        await requester.request("requester.nobody", b"", timeout=5)

    async def ignore(msg: Msg) -> None:
        pass

    await nc.subscribe("requester.silent", cb=ignore)
    await flush(nc)
    with pytest.raises(NatsTimeoutError):
        await requester.request("requester.silent", b"", timeout=0.2)


async def test_deliver_inline_hands_over_every_message_in_order(nc: Client) -> None:
    """A subscription made without a callback, its messages taken as they are parsed: all of
    them, in the order published, none left pending, and unsubscribing still works."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    taken: list[bytes] = []
    deliver_inline(sub, lambda msg: taken.append(msg.data))
    for i in range(1000):
        await nc.publish(inbox, str(i).encode())
    await flush(nc)
    await wait_for(lambda: len(taken) == 1000)
    assert taken == [str(i).encode() for i in range(1000)]
    assert sub.pending_msgs == 0
    await sub.unsubscribe()
    await nc.publish(inbox, b"after")
    await flush(nc)
    assert len(taken) == 1000
