"""`first_done`, the wait a Dispatch's retry loop makes for the first of its copies' replies."""

from __future__ import annotations

import asyncio

from broker.executor import first_done


async def test_it_returns_when_one_future_is_done_and_leaves_the_others_alone() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    loop.call_later(0.01, b.set_result, "ack")
    started = loop.time()
    await first_done([a, b], 30.0)
    assert loop.time() - started < 5.0
    assert b.done() and not a.done()


async def test_it_returns_after_the_timeout_without_touching_the_futures() -> None:
    loop = asyncio.get_running_loop()
    a = loop.create_future()
    started = loop.time()
    await first_done([a], 0.05)
    assert loop.time() - started >= 0.05
    assert not a.done()


async def test_a_future_already_done_returns_at_once() -> None:
    loop = asyncio.get_running_loop()
    a = loop.create_future()
    a.set_result("ack")
    started = loop.time()
    await first_done([a], 30.0)
    assert loop.time() - started < 1.0


async def test_a_cancelled_wait_is_cancelled_and_leaves_the_future_pending() -> None:
    loop = asyncio.get_running_loop()
    a = loop.create_future()
    task = asyncio.create_task(first_done([a], 30.0))
    await asyncio.sleep(0.01)
    task.cancel()
    (outcome,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(outcome, asyncio.CancelledError)
    assert not a.done()
