"""What every test folder shares: waiting for a condition instead of sleeping (`wait_for`
lives in `load/waiting.py`, which the load programs share), free ports, TCP helpers, where the
repository's deploy tree and shared fixtures are."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from load.waiting import POLL_S, wait_for

__all__ = ["POLL_S", "wait_for"]

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"  # the shipped manifests, configs and Dockerfile
FIXTURES = REPO / "tests" / "fixtures"  # inputs shared across test folders (README there)


def fixture_doc(name: str) -> dict[str, Any]:
    """The one YAML document of a shared fixture, a fresh copy on every call."""
    doc: dict[str, Any] = yaml.safe_load((FIXTURES / name).read_text(encoding="utf-8"))
    return doc


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
