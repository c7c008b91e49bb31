"""The fence watchdog: the agent renews one Lease per cluster while the broker hears it; once
a hung agent stops renewing it, the watchdog deletes every fenced workload object (here a
PyTorchJob), so the operator's pods end without the agent. Time is the injected clock; only
the retry loop runs on (short) real timers."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from agents.kube.client import KubeRest
from agents.kube.fence import ANN_FENCE_UNTIL, ANN_FENCED, lease_path
from agents.kube.watchdog import FenceWatchdog, WatchdogCollector, WatchdogConfig, serve
from kinds.kubeflow import PYTORCHJOB
from kinds.plan import owner_reference
from schemas.agent import Dispatch
from tests.kube.conftest import NOW, NS, PODS, Clock, Recorder, manifest_dispatch, pod
from tests.kube.exec_auth import expiry, write_kubeconfig
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.manifests import PYTORCHJOB_YAML

PYTORCHJOBS = PYTORCHJOB.collection(NS)
FENCE_AFTER_S = 20.0
SKEW_S = 2.0


def pytorch_dispatch(job_id: str, fence_after_s: float = FENCE_AFTER_S) -> Dispatch:
    cmd = manifest_dispatch(PYTORCHJOB_YAML, job_id=job_id, attempt=1)
    return msgspec.structs.replace(cmd, fence_after_s=fence_after_s)


def job_path(server: FakeApiServer, job_id: str) -> str:
    for obj in server.items("kubeflow.org/v1", "pytorchjobs"):
        if obj["metadata"]["annotations"].get("muster.dev/job-id") == job_id:
            return f"{PYTORCHJOBS}/{obj['metadata']['name']}"
    raise AssertionError(f"no PyTorchJob of {job_id}")


def lease_until_of(server: FakeApiServer) -> str | None:
    lease = server.get(lease_path(NS))
    assert lease is not None
    value: str | None = lease["metadata"]["annotations"].get(ANN_FENCE_UNTIL)
    return value


def operator_pod(server: FakeApiServer, path: str, index: int) -> str:
    """A running pod the training operator made for the job (owned by it)."""
    job = server.get(path)
    assert job is not None
    p = pod(f"{job['metadata']['name']}-worker-{index}", f"n{index}", namespace=NS, gpu=2)
    meta = job["metadata"]
    p["metadata"]["ownerReferences"] = [owner_reference(PYTORCHJOB, meta["name"], meta["uid"])]
    server.put(PODS, p)
    return f"{PODS}/{p['metadata']['name']}"


def ended(server: FakeApiServer, path: str) -> bool:
    obj = server.get(path)
    return obj is None or bool(obj["metadata"].get("deletionTimestamp"))


def make_watchdog(api_client: Any, clock: Clock, **overrides: Any) -> FenceWatchdog:
    config = msgspec.convert({"namespace": NS, "skew_s": SKEW_S, **overrides}, WatchdogConfig)
    return FenceWatchdog(KubeRest(api_client), config, clock=clock)


async def test_a_hung_agents_pytorchjob_is_deleted_once_its_lease_lapses(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    await backend.dispatch(pytorch_dispatch("pt-1"))
    path = job_path(apiserver, "pt-1")
    assert lease_until_of(apiserver) == f"{NOW + FENCE_AFTER_S:.3f}"
    assert backend.fences("pt-1", 1)  # the cluster fences it: the watchdog runs
    pods = [operator_pod(apiserver, path, i) for i in (1, 2)]
    watchdog = make_watchdog(api_client, clock)

    # Healthy: renewals move the one Lease; the watchdog only reads it.
    clock.advance(10)
    await backend.renew_fence(clock.now)
    assert lease_until_of(apiserver) == f"{NOW + 30:.3f}"
    requests = len(apiserver.requests)
    assert await watchdog.sweep() == 0
    assert len(apiserver.requests) == requests + 1  # one GET of the Lease, no list

    # Hung: past the fence but within the skew margin, nothing happens ...
    clock.advance(FENCE_AFTER_S + SKEW_S - 0.1)
    assert await watchdog.sweep() == 0
    assert not any(ended(apiserver, p) for p in pods) and apiserver.get(path) is not None
    # ... beyond it the watchdog deletes the job, and its pods go with it.
    clock.advance(0.2)
    assert await watchdog.sweep() == 1
    assert apiserver.get(path) is None and all(ended(apiserver, p) for p in pods)
    assert watchdog.deleted == 1
    deletes = [q for m, p, q in apiserver.requests if m == "DELETE" and p == path]
    assert deletes == [{"propagationPolicy": "Background"}]
    metric = next(iter(WatchdogCollector(watchdog).collect()))
    assert {s.labels["counter"]: s.value for s in metric.samples}["deleted"] == 1.0

    # The agent thaws and renews: later attempts are fenced again, nothing is deleted.
    await backend.renew_fence(clock.now)
    await backend.dispatch(pytorch_dispatch("pt-2"))
    assert await watchdog.sweep() == 0
    assert apiserver.get(job_path(apiserver, "pt-2")) is not None


async def test_unfenced_and_foreign_objects_are_left_alone(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    watchdog = make_watchdog(api_client, clock)
    await backend.dispatch(pytorch_dispatch("unfenced", fence_after_s=0))
    unfenced = job_path(apiserver, "unfenced")
    clock.advance(10_000)
    assert await watchdog.sweep() == 0  # no Lease at all: never fenced, nothing to enforce
    clock.now = NOW
    await backend.dispatch(pytorch_dispatch("fenced"))
    fenced = job_path(apiserver, "fenced")
    assert ANN_FENCED not in (apiserver.get(unfenced) or {})["metadata"]["annotations"]
    # Not Muster's (no labels), though marked: never listed, never deleted.
    foreign = apiserver.get(fenced)
    assert foreign is not None
    apiserver.put(
        PYTORCHJOBS,
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": "someone-elses", "annotations": {ANN_FENCED: "cluster"}},
            "spec": foreign["spec"],
        },
    )
    clock.advance(FENCE_AFTER_S + SKEW_S + 1)
    assert await watchdog.sweep() == 1
    assert apiserver.get(fenced) is None and apiserver.get(unfenced) is not None
    assert apiserver.get(f"{PYTORCHJOBS}/someone-elses") is not None
    assert apiserver.rejected == []


@pytest.mark.parametrize(
    ("method", "status"), [("GET", 500), ("GET", 429), ("DELETE", 500), ("DELETE", 503)]
)
async def test_api_errors_are_retried(
    apiserver: FakeApiServer, make_backend: Any, method: str, status: int
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    await backend.dispatch(pytorch_dispatch("pt-4"))
    path = job_path(apiserver, "pt-4")
    created = apiserver.get(path)
    assert created is not None
    # The same object on an API server only the watchdog talks to (the agent is gone), so
    # every injected failure is the watchdog's.
    async with FakeApiServer(validate=True) as server:
        server.put(PYTORCHJOBS, created)
        lease = apiserver.get(lease_path(NS))
        assert lease is not None
        server.put(lease_path(NS).rsplit("/", 1)[0], lease)
        client = ApiClient(configuration=Configuration(host=server.url))
        clock.advance(FENCE_AFTER_S + SKEW_S + 1)
        prefix = PYTORCHJOBS if method == "GET" else path
        for _ in range(3):  # a short outage: three failures in a row
            server.fail_next(method, prefix, status, retry_after=0.01 if status == 429 else None)
        watchdog = make_watchdog(client, clock, period_s=0.01, backoff_initial_s=0.01)
        stop = asyncio.Event()
        task = asyncio.create_task(watchdog.run(stop))
        try:
            await Recorder().wait_for(lambda: server.get(path) is None)
            await Recorder().wait_for(lambda: watchdog.outage.since is None)
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=5)
            await client.close()
    assert watchdog.deleted == 1
    if status == 429:  # honoured inside the client after its Retry-After, as client-go does
        assert watchdog.rest.throttled == 3 and watchdog.failures == 0
    else:  # each failure fails one sweep, retried after a backoff
        assert watchdog.failures == 3


async def test_the_process_entry_reads_a_kubeconfig_and_deletes_lapsed_objects(
    apiserver: FakeApiServer, make_backend: Any, tmp_path: Path
) -> None:
    """`muster fence-watchdog`'s coroutine, on its own API client and the wall clock (the
    stand-in backend's clock is decades behind it, so its Lease is long lapsed)."""
    kubeconfig, token_file = write_kubeconfig(tmp_path, apiserver.url)
    token_file.write_text(f"t1 {expiry(3600)}")
    backend, _ = await make_backend(fence_watchdog=True)
    await backend.dispatch(pytorch_dispatch("lapsed"))
    await backend.dispatch(pytorch_dispatch("unfenced", fence_after_s=0))
    await backend.stop()
    lapsed, unfenced = job_path(apiserver, "lapsed"), job_path(apiserver, "unfenced")
    apiserver.tokens = {"t1"}  # from now on only the kubeconfig's token is accepted
    config = WatchdogConfig(namespace=NS, period_s=0.05)
    task = asyncio.create_task(serve(config, in_cluster=False, kubeconfig=str(kubeconfig)))
    try:
        await Recorder().wait_for(lambda: apiserver.get(lapsed) is None)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert apiserver.get(unfenced) is not None
