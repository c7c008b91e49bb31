"""What every test folder shares: waiting for a condition instead of sleeping."""

from __future__ import annotations

import asyncio
import inspect
import socket
import struct
import threading
import time
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
    again whenever `changed` is set (or every `interval`); fail the test after `timeout` seconds,
    naming `what` was awaited."""
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


async def listening(port: int, timeout: float = 10.0) -> None:
    """Wait until a server just started accepts TCP connections on 127.0.0.1:`port`."""

    async def accepts() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        writer.close()
        return True

    await wait_for(accepts, timeout, what=f"a server listening on port {port}", interval=0.02)


def wait_for_sync(condition: Callable[[], T | None], timeout: float = 5.0, what: str = "") -> T:
    """`wait_for` for code outside an event loop (threads, subprocess pipes)."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout}s")
        time.sleep(POLL_S)


class ResettingPort:
    """A server that cannot be reached, whose connection attempts can be counted: a local
    port that accepts each TCP connection and resets it at once (what the client sees is a
    connection reset, an OSError like a refused connection). Serves from a thread, so it
    works beside a blocked event loop and in tests without one."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(POLL_S)
        self.port: int = self._sock.getsockname()[1]
        self.attempts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.attempts += 1

    def close(self) -> None:
        """Stop serving; the port is free again (nothing lingers after a reset)."""
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def __enter__(self) -> ResettingPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
