"""A real nats-server running the authorization `muster nats-config` generates, and
connections as each of its users with that user's own password and inbox prefix."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import nats
import pytest_asyncio
from nats.aio.client import Client

from broker.client import MusterClient
from broker.embedded import free_port, nats_server_binary
from broker.natsconfig import inbox_prefix, password_var, render
from broker.service import Broker
from schemas.config import BrokerConfig, QueueConfig
from schemas.natsopts import NatsOptions
from shell.natsio import flush
from tests.broker.conftest import harness  # noqa: F401  (the broker harness fixture)
from tests.local.conftest import lab  # noqa: F401  (broker and two local agents)
from tests.support import listening

CONFIG = BrokerConfig(
    queues=[
        QueueConfig(name="vision", team="alpha"),
        QueueConfig(name="speech", team="beta"),
        QueueConfig(name="ops"),
    ],
    queue_aliases={"vision-batch": "vision"},
)
CLUSTERS = ["east", "west"]


def users_in(conf: str) -> list[str]:
    return re.findall(r'user: "([^"]+)"', conf)


def passwords(conf: str) -> dict[str, str]:
    return {password_var(u): f"pw-{u}" for u in users_in(conf)}


class AuthNats:
    """The server and a way to connect as one of its users; refusals land in `errors`."""

    def __init__(self, url: str, store: Path) -> None:
        self.url = url
        self.store = store
        self.errors: dict[str, list[Exception]] = {}
        self.conns: list[Client] = []

    async def connect(self, user: str, *, prefix: str | None = None) -> Client:
        errors = self.errors.setdefault(user, [])

        async def on_error(e: Exception) -> None:
            errors.append(e)

        nc = await nats.connect(
            self.url,
            user=user,
            password=f"pw-{user}",
            inbox_prefix=prefix or inbox_prefix(user),
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=2,
        )
        self.conns.append(nc)
        return nc


async def start_auth_nats(tmp: Path, conf: str) -> tuple[asyncio.subprocess.Process, AuthNats]:
    (tmp / "accounts.conf").write_text(conf)
    port = free_port()
    (tmp / "server.conf").write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{tmp / "js"}" }}\n'
        "include ./accounts.conf\n"
    )
    proc = await asyncio.create_subprocess_exec(
        nats_server_binary(),
        "-c",
        str(tmp / "server.conf"),
        env={**os.environ, **passwords(conf)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = AuthNats(f"nats://127.0.0.1:{port}", tmp)
    try:
        await listening(port)
    except AssertionError:
        proc.terminate()
        raise AssertionError("nats-server with the generated config did not start") from None
    return proc, server


@pytest_asyncio.fixture
async def auth_nats(tmp_path: Path) -> AsyncIterator[AuthNats]:
    proc, server = await start_auth_nats(tmp_path, render(CONFIG, CLUSTERS))
    try:
        yield server
    finally:
        for c in server.conns:
            if not c.is_closed:
                await c.close()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=10)


Connect = Callable[[str], Awaitable[Any]]


def options_as(server: AuthNats, user: str, team: str | None = None) -> NatsOptions:
    """The options a party of the generated config connects with: its user, its password, its
    private inbox prefix and (for a team) the team it acts as."""
    return NatsOptions(
        url=server.url,
        user=user,
        password=f"pw-{user}",
        inbox_prefix=inbox_prefix(user),
        team=team,
    )


async def client_as(server: AuthNats, user: str, team: str | None = None) -> MusterClient:
    return await MusterClient(options_as(server, user, team)).connect()


@pytest_asyncio.fixture
async def broker(auth_nats: AuthNats) -> AsyncIterator[Broker]:
    """A real broker connected as the `broker` user; what NATS refuses it lands in
    `auth_nats.errors["broker"]`."""
    bnc = await auth_nats.connect("broker")
    b = Broker(CONFIG, bnc)
    task = asyncio.create_task(b.run())
    try:
        await asyncio.wait_for(b.leading.wait(), 15)
        yield b
    finally:
        await b.stop()
        await asyncio.wait_for(task, 15)
        await bnc.close()


async def overhear(nc: Client, subjects: Iterable[str]) -> list[str]:
    """Subscribe `nc` to each subject; the list fills with the subjects of what arrives."""
    heard: list[str] = []

    async def hear(msg: Any) -> None:
        heard.append(msg.subject)

    for subject in subjects:
        await nc.subscribe(subject, cb=hear)
    await flush(nc)
    return heard
