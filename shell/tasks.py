"""Ending background tasks without swallowing the caller's own cancellation.

`task.cancel(); with suppress(CancelledError): await task` also swallows a cancel aimed at the
task that waits: if the caller is cancelled while the child winds down, the CancelledError it
receives is the suppressed one, and the caller carries on as if nothing happened. A broker
cancelled while stepping down then went back to standing by, for ever.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel `tasks` and wait until each has finished. How they ended (cancelled, or an
    error) is theirs and not raised here; a cancellation of the caller is."""
    live = {task for task in tasks if task is not None}
    for task in live:
        task.cancel()
    if not live:
        return
    await asyncio.wait(live)
    for task in live:
        if not task.cancelled():
            task.exception()  # retrieved: an error of a stopped task is not worth a warning
