"""End to end: the real broker shell, the real agent runtime and fake clusters, all on a real
nats-server (tests/world.py); for the kube backend, two clusters each behind a stand-in
Kubernetes API server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from kubernetes_asyncio.client import ApiClient, Configuration

from agents.runtime import AgentRuntime
from tests.kube.conftest import NODES
from tests.kube.fake_apiserver import FakeApiServer
from tests.world import World, flavor, sim_job, world

__all__ = ["KubeSide", "World", "flavor", "kube_clusters", "sim_job", "world"]

CLUSTERS = ("east", "west")


class KubeSide(Protocol):
    """One kube cluster of a test: its API server, its agent, and the loop that plays
    Kubernetes' controllers for it."""

    name: str
    server: FakeApiServer
    api: ApiClient
    runtime: AgentRuntime

    def play(self) -> Coroutine[Any, Any, None]: ...


C = TypeVar("C", bound=KubeSide)


@contextlib.asynccontextmanager
async def kube_clusters(
    world: World,
    nodes: Callable[[str], list[dict[str, Any]]],
    build: Callable[[str, FakeApiServer, ApiClient], C],
    **server_options: Any,
) -> AsyncIterator[dict[str, C]]:
    """Start the world's broker, then east and west: an API server holding `nodes(name)`,
    the cluster `build` makes (with its agent runtime), and its `play` loop; each is synced
    with the broker before the next starts. Everything is stopped on the way out."""
    h = world.harness
    await h.start_broker()
    clusters: dict[str, C] = {}
    servers: list[FakeApiServer] = []
    loops: list[asyncio.Task[None]] = []
    try:
        for name in CLUSTERS:
            server = FakeApiServer(**server_options)
            servers.append(server)
            await server.start()
            for n in nodes(name):
                server.put(NODES, n)
            api = ApiClient(configuration=Configuration(host=server.url))
            cluster = clusters[name] = build(name, server, api)
            await cluster.runtime.start()
            loops.append(asyncio.create_task(cluster.play()))
            await h.wait_for(lambda name=name: h.synced(name))  # type: ignore[misc]
        yield clusters
    finally:
        for task in loops:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for c in clusters.values():
            await c.runtime.stop()
            await c.api.close()
        for server in servers:
            await server.close()
