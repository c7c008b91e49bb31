"""The in-pod self-fence of the SDK: a workload that can no longer see a live fence Lease stops
by itself, before the broker could start its job elsewhere; an API-server outage shorter than
the window stops nothing; a cluster without a Lease is never fenced. The Lease is the one the
kube agent writes, served by the stand-in API server; time is an injected clock."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec

from agents.sdk import FenceWatch, fence_url
from tests.kube.conftest import NOW, NS, Clock, gang_dispatch
from tests.kube.fake_apiserver import FakeApiServer

WINDOW_S = 900.0


async def fenced_cluster(apiserver: FakeApiServer, make_backend: Any, clock: Clock) -> Any:
    backend, _ = await make_backend(clock=clock)
    await backend.dispatch(msgspec.structs.replace(gang_dispatch(), fence_after_s=WINDOW_S))
    return backend


def watch_of(apiserver: FakeApiServer, clock: Clock, tmp_path: Path) -> FenceWatch:
    url = fence_url({"MUSTER_FENCE_URL": ""}, sa_dir=str(tmp_path))
    assert url is None  # no namespace file, no service host: not in a cluster
    (tmp_path / "namespace").write_text(NS)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    url = fence_url(env, sa_dir=str(tmp_path))
    assert url == (
        f"https://127.0.0.1:6443/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/muster-fence"
    )
    plain = url.replace("https://127.0.0.1:6443", apiserver.url)
    return FenceWatch(plain, token_file=str(tmp_path / "token"), clock=clock)


async def test_the_workload_stops_once_the_lease_it_saw_has_lapsed(
    apiserver: FakeApiServer, make_backend: Any, tmp_path: Path
) -> None:
    clock = Clock()
    backend = await fenced_cluster(apiserver, make_backend, clock)
    watch = watch_of(apiserver, clock, tmp_path)
    assert await asyncio.to_thread(watch.refresh) == NOW + WINDOW_S
    clock.advance(600)
    await backend.renew_fence(clock.now)  # the agent is heard: the deadline moves on
    assert await asyncio.to_thread(watch.refresh) == clock.now + WINDOW_S
    assert not watch.lapsed()

    apiserver.down = True  # the cluster is cut off; ten minutes of failed reads stop nothing
    for _ in range(20):
        clock.advance(30)
        await asyncio.to_thread(watch.refresh)
        assert not watch.lapsed()
    assert watch.failures == 20
    clock.advance(WINDOW_S - 600)  # past the last deadline it saw: stop
    assert watch.lapsed()

    stopped: list[float] = []
    stop = threading.Event()
    await asyncio.wait_for(
        asyncio.to_thread(watch.run, stop, 0.01, lambda: stopped.append(clock.now)), timeout=10
    )
    assert stopped == [clock.now]


async def test_without_a_lease_nothing_is_fenced(apiserver: FakeApiServer, tmp_path: Path) -> None:
    clock = Clock()
    watch = watch_of(apiserver, clock, tmp_path)
    assert await asyncio.to_thread(watch.refresh) is None
    clock.advance(10 * WINDOW_S)
    assert watch.absent and not watch.lapsed()
