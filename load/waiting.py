"""Waiting for a condition instead of sleeping: the tests and the load programs that drive
real servers (`load/natscluster.py`) share it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01  # how often a condition is looked at when nothing signals a change


async def wait_for(
    condition: Callable[[], T | None] | Callable[[], Awaitable[T | None]],
    timeout: float = 5.0,
    *,
    changed: asyncio.Event | None = None,
    what: str = "",
    interval: float = POLL_S,
) -> T:
    """Return the condition's first truthy value (awaited when it is a coroutine), looking
    again whenever `changed` is set (or every `interval`); raise after `timeout` seconds,
    naming `what` was awaited (an AssertionError, so a test fails with it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = condition()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(f"{what or 'condition'} not met within {timeout}s")
        if changed is None:
            await asyncio.sleep(min(left, interval))
            continue
        changed.clear()
        try:
            async with asyncio.timeout(min(left, 0.05)):
                await changed.wait()
        except TimeoutError:
            pass
