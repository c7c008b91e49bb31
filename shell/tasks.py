"""Ending background tasks without swallowing the caller's own cancellation, and sharing one
run of a task among the callers that ask for it while it is under way (`Shared`).

`task.cancel(); with suppress(CancelledError): await task` also swallows a cancel aimed at the
task that waits: if the caller is cancelled while the child winds down, the CancelledError it
receives is the suppressed one, and the caller carries on as if nothing happened. A broker
cancelled while stepping down then went back to standing by, for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

RECANCEL_S = 2.0  # how long a task may take to end before it is cancelled again


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, again_s: float = RECANCEL_S) -> None:
    """Cancel `tasks` and wait until each has finished. How they ended (cancelled, or an
    error) is theirs and not raised here; a cancellation of the caller is.

    A task still running after `again_s` is cancelled again: on Python 3.11 a cancel that
    lands as an awaited `asyncio.wait_for` completes is lost (fixed in 3.12), and the task
    then runs on; a broker stopping waited for its lease renewals for ever."""
    live = {task for task in tasks if task is not None}
    for task in live:
        task.cancel()
    pending = set(live)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=again_s)
        for task in pending:
            task.cancel()
    for task in live:
        if not task.cancelled():
            task.exception()  # retrieved: an error of a stopped task is not worth a warning


class Shared(Generic[K, T]):
    """One run per key at a time: a caller that asks for a key whose run is under way awaits
    that run's result instead of starting another; nothing is kept once a run ends. A caller
    cancelled while it waits leaves the run going for the others (`asyncio.shield`)."""

    def __init__(self) -> None:
        self._runs: dict[K, asyncio.Future[T]] = {}

    def under_way(self, key: K) -> bool:
        return key in self._runs

    async def run(self, key: K, start: Callable[[], Awaitable[T]]) -> T:
        """The result of the run of `key` under way, or of a new one `start()` begins."""
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = asyncio.ensure_future(start())
            run.add_done_callback(lambda _: self._runs.pop(key, None))
        return await asyncio.shield(run)
