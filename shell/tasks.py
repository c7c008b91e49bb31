"""Ending background tasks without swallowing the caller's own cancellation.

`task.cancel(); with suppress(CancelledError): await task` also swallows a cancel aimed at the
task that waits: if the caller is cancelled while the child winds down, the CancelledError it
receives is the suppressed one, and the caller carries on as if nothing happened. A broker
cancelled while stepping down then went back to standing by, for ever.
"""

from __future__ import annotations

import asyncio
from typing import Any

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
