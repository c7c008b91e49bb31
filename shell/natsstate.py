"""NATS connection state for operators: one log line per change, not one per retry.

nats-py calls `error_cb` on every failed (re)connect attempt, twice a second. An operator needs
to read "cannot reach NATS at URL; retrying" once, with what to check, then "connected" when
it works again. Other errors (permissions, slow consumers) are still logged each time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.errors import NoServersError

_CONNECT_ERRORS = (OSError, asyncio.TimeoutError, NoServersError)


class NatsStateLog:
    """Callbacks for `nats.connect` that log state changes of one connection once each."""

    def __init__(self, log: Any, url: str, hint: str) -> None:
        self._log = log
        self._url = url
        self._hint = hint
        self.state = "connecting"
        self.nc: Any = None  # the client, once connected: a disconnect while draining is quiet

    def callbacks(self) -> dict[str, Any]:
        return {
            "error_cb": self.on_error,
            "disconnected_cb": self.on_disconnected,
            "reconnected_cb": self.on_reconnected,
        }

    def connected(self, nc: Any) -> None:
        """Call once `nats.connect` returned."""
        self.nc = nc
        if self.state != "connected":
            self._log.info("nats connected", url=self._url)
            self.state = "connected"

    async def on_error(self, exc: Exception) -> None:
        if not isinstance(exc, _CONNECT_ERRORS):
            self._log.warning("nats error", error=str(exc) or type(exc).__name__)
            return
        if self.state == "unreachable":
            return
        self.state = "unreachable"
        self._log.warning(
            "cannot reach NATS; retrying every 0.5s until it answers",
            url=self._url,
            error=str(exc) or type(exc).__name__,
            hint=self._hint,
        )

    async def on_disconnected(self) -> None:
        if self.nc is not None and (self.nc.is_closed or self.nc.is_draining):
            return  # our own shutdown
        if self.state == "connected":
            self.state = "disconnected"
            self._log.warning("nats disconnected; reconnecting", url=self._url)

    async def on_reconnected(self) -> None:
        self.state = "connected"
        self._log.info("nats reconnected", url=self._url)
