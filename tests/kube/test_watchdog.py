"""The fence watchdog: operator kinds (here a PyTorchJob) carry the broker-granted fence as the
annotation muster.dev/fence-until; the healthy agent moves it forward, and once a hung agent
stops moving it the watchdog deletes the object, so the operator's pods end without the agent.
Time is the injected clock; only the retry loop runs on (short) real timers."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from agents.kube.client import KubeRest
from agents.kube.fence import ANN_FENCE_UNTIL, PATCH_STEP_S
from agents.kube.watchdog import FenceWatchdog, WatchdogCollector, WatchdogConfig, serve
from kinds.kubeflow import PYTORCHJOB
from kinds.plan import owner_reference
from schemas.agent import Dispatch
from tests.kube.conftest import NOW, NS, PODS, Clock, Recorder, manifest_dispatch, pod
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.test_manifests import PYTORCHJOB_YAML
from tests.kube.test_watches import expiry, write_kubeconfig

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


def until_of(server: FakeApiServer, path: str) -> str | None:
    obj = server.get(path)
    assert obj is not None
    value: str | None = obj["metadata"]["annotations"].get(ANN_FENCE_UNTIL)
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


async def test_a_hung_agents_pytorchjob_is_deleted_once_its_fence_lapses(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    await backend.dispatch(pytorch_dispatch("pt-1"))
    path = job_path(apiserver, "pt-1")
    assert until_of(apiserver, path) == f"{NOW + FENCE_AFTER_S:.3f}"
    assert backend.fences("pt-1", 1)  # the cluster fences it: the watchdog runs
    pods = [operator_pod(apiserver, path, i) for i in (1, 2)]
    watchdog = make_watchdog(api_client, clock)

    # Healthy: extensions move the annotation once it grew a step.
    await backend.fence("pt-1", 1, NOW + FENCE_AFTER_S + PATCH_STEP_S / 2)
    assert until_of(apiserver, path) == f"{NOW + FENCE_AFTER_S:.3f}"
    clock.advance(10)
    await backend.fence("pt-1", 1, clock.now + FENCE_AFTER_S)
    assert until_of(apiserver, path) == f"{NOW + 30:.3f}"
    assert await watchdog.sweep() == 0

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

    # The agent thaws: a lapsed fence is never moved again, and the next sweep is a no-op.
    patches = len(apiserver.patches)
    await backend.fence("pt-1", 1, clock.now + FENCE_AFTER_S)
    assert len(apiserver.patches) == patches
    assert await watchdog.sweep() == 0


async def test_unfenced_foreign_and_extended_objects_are_left_alone(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    await backend.dispatch(pytorch_dispatch("unfenced", fence_after_s=0))
    await backend.dispatch(pytorch_dispatch("extended"))
    await backend.dispatch(pytorch_dispatch("frozen"))
    unfenced, extended, frozen = (
        job_path(apiserver, j) for j in ("unfenced", "extended", "frozen")
    )
    assert until_of(apiserver, unfenced) is None and not backend.fences("unfenced", 1)
    # Not Muster's (no labels), yet with a lapsed annotation: never listed, never deleted.
    foreign = apiserver.get(frozen)
    assert foreign is not None
    apiserver.put(
        PYTORCHJOBS,
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {
                "name": "someone-elses",
                "annotations": {ANN_FENCE_UNTIL: "1.000"},
            },
            "spec": foreign["spec"],
        },
    )
    watchdog = make_watchdog(api_client, clock)

    clock.advance(15)
    await backend.fence("extended", 1, clock.now + FENCE_AFTER_S)  # healthy for this one
    clock.advance(FENCE_AFTER_S - 15 + SKEW_S + 1)
    assert await watchdog.sweep() == 1
    assert apiserver.get(frozen) is None
    assert apiserver.get(extended) is not None and apiserver.get(unfenced) is not None
    assert apiserver.get(f"{PYTORCHJOBS}/someone-elses") is not None

    # Much later, still only fenced objects go: the unfenced one stays whatever the time.
    clock.advance(10_000)
    assert await watchdog.sweep() == 1
    assert apiserver.get(extended) is None and apiserver.get(unfenced) is not None
    assert apiserver.rejected == []


POD_YAML = (
    "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, image: i}]}"
)


@pytest.mark.parametrize("manifest", [PYTORCHJOB_YAML, POD_YAML], ids=["pytorchjob", "pod"])
async def test_a_restarted_agent_takes_up_the_annotation(
    apiserver: FakeApiServer, make_backend: Any, manifest: str
) -> None:
    """Else the watchdog would end a healthy attempt at the fence it was created with."""
    clock = Clock()
    first, _ = await make_backend(clock=clock, fence_watchdog=True)
    cmd = msgspec.structs.replace(
        manifest_dispatch(manifest, job_id="pt-2", attempt=1), fence_after_s=FENCE_AFTER_S
    )
    await first.dispatch(cmd)
    (collection, name) = first._workloads[("pt-2", 1)].objects[0]
    path = f"{collection}/{name}"
    assert collection.endswith("/pods" if manifest == POD_YAML else "/pytorchjobs")
    assert until_of(apiserver, path) == f"{NOW + FENCE_AFTER_S:.3f}"
    await first.stop()
    clock.advance(10)
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    await Recorder().wait_for(lambda: ("pt-2", 1) in backend._workloads)
    await Recorder().wait_for(lambda: backend.fences("pt-2", 1))
    await backend.fence("pt-2", 1, clock.now + FENCE_AFTER_S)
    assert until_of(apiserver, path) == f"{NOW + 30:.3f}"
    assert apiserver.rejected == []


async def test_a_retried_dispatch_renews_the_existing_objects_fence(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    clock = Clock()
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    await backend.dispatch(pytorch_dispatch("pt-5"))
    path = job_path(apiserver, "pt-5")
    clock.advance(10)
    await backend.dispatch(pytorch_dispatch("pt-5"))  # 409: it exists
    assert until_of(apiserver, path) == f"{NOW + 10 + FENCE_AFTER_S:.3f}"
    clock.advance(PATCH_STEP_S)
    await backend.fence("pt-5", 1, clock.now + FENCE_AFTER_S)
    assert until_of(apiserver, path) == f"{clock.now + FENCE_AFTER_S:.3f}"


async def test_without_the_watchdog_operator_kinds_keep_the_self_fence(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, _ = await make_backend()
    await backend.dispatch(pytorch_dispatch("pt-3"))
    assert until_of(apiserver, job_path(apiserver, "pt-3")) is None
    assert not backend.fences("pt-3", 1)


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
    stand-in backend's clock is decades behind it, so its fence is long past)."""
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
