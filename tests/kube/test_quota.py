"""A namespace's ResourceQuota: the stand-in refuses a create over quota as the API server
does (403, `exceeded quota: ...`), and the agent refuses an attempt that would exceed it before
creating anything, so the broker sees a refused dispatch with the reason instead of a workload
whose pods the Job controller can never create."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from kubernetes_asyncio.client import ApiClient
from nats.aio.client import Client

from agents.backend import BackendError, JobRefused
from agents.kube.backend import KubeBackend
from agents.kube.client import KubeApiError, KubeRest
from agents.kube.quota import (
    KResourceQuota,
    QuotaReads,
    attempt_usage,
    quota_message,
    quota_refusal,
)
from agents.runtime import AgentRuntime
from tests.agents.helpers import BrokerWire, unique
from tests.kube.conftest import (
    NODES,
    NS,
    Recorder,
    dispatch,
    gang_dispatch,
    make_config,
    node,
    pod,
)
from tests.kube.fake_apiserver import FakeApiServer

QUOTAS = f"/api/v1/namespaces/{NS}/resourcequotas"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
GPU_OVER = (
    "exceeded quota: gpu, requested: requests.nvidia.com/gpu=8, "
    "used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=8"
)


def quota(name: str, hard: dict[str, str], used: dict[str, str]) -> dict[str, Any]:
    """A ResourceQuota as the quota controller leaves it: status.hard from spec, and used."""
    return {
        "metadata": {"name": name},
        "spec": {"hard": hard},
        "status": {"hard": hard, "used": used},
    }


def new_pod(name: str, gpu: int = 0) -> dict[str, Any]:
    """A pod as a client posts it (unscheduled)."""
    body = {"apiVersion": "v1", "kind": "Pod", **pod(name, "", namespace=NS, gpu=gpu)}
    body["spec"].pop("nodeName", None)
    body.pop("status", None)
    return body


def gpu_quota(used: str = "4") -> dict[str, Any]:
    return quota("gpu", {"requests.nvidia.com/gpu": "8"}, {"requests.nvidia.com/gpu": used})


async def test_stand_in_refuses_a_pod_over_quota_with_the_real_status(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    apiserver.put(QUOTAS, gpu_quota())
    rest = KubeRest(api_client, 30.0)
    big = new_pod("big", gpu=8)
    with pytest.raises(KubeApiError) as err:
        await rest.create(f"/api/v1/namespaces/{NS}/pods", big)
    assert err.value.status == 403
    body = apiserver.forbidden[-1]
    assert body["reason"] == "Forbidden" and body["code"] == 403
    assert body["message"] == f'pods "big" is forbidden: {GPU_OVER}'
    assert body["details"] == {"name": "big", "group": "", "kind": "pods"}
    # One that fits is admitted and charged to the quota.
    await rest.create(f"/api/v1/namespaces/{NS}/pods", new_pod("small", gpu=4))
    charged = apiserver.get(f"{QUOTAS}/gpu")
    assert charged is not None
    assert charged["status"]["used"]["requests.nvidia.com/gpu"] == "8"


async def test_stand_in_refuses_a_quota_without_usage_figures(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    apiserver.put(QUOTAS, quota("fresh", {"pods": "10"}, {}))
    with pytest.raises(KubeApiError, match="status unknown for quota: fresh"):
        await KubeRest(api_client, 30.0).create(f"/api/v1/namespaces/{NS}/pods", new_pod("p"))


def test_agent_check_speaks_the_api_servers_words() -> None:
    """The agent's own check, against the stand-in's figures: same refusal text."""
    usage = attempt_usage(gang_dispatch(replicas=2), "nvidia.com/gpu")
    assert usage["requests.nvidia.com/gpu"] == 8 and usage["pods"] == 2

    quotas = msgspec.convert([gpu_quota()], list[KResourceQuota])
    assert quota_refusal(quotas, usage) == GPU_OVER
    assert quota_refusal(msgspec.convert([gpu_quota("0")], list[KResourceQuota]), usage) is None
    cpu = msgspec.convert(
        [quota("cpu", {"requests.cpu": "1500m"}, {"requests.cpu": "0"})], list[KResourceQuota]
    )
    assert quota_refusal(cpu, usage) == (
        "exceeded quota: cpu, requested: requests.cpu=2, used: requests.cpu=0, "
        "limited: requests.cpu=1500m"
    )


async def test_attempt_over_quota_is_refused_before_anything_is_created(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    apiserver.put(QUOTAS, gpu_quota())
    backend, _ = await make_backend()
    with pytest.raises(BackendError) as err:
        await backend.dispatch(gang_dispatch(replicas=2))
    assert f"namespace {NS}: {GPU_OVER}" in str(err.value)
    assert "Raise the ResourceQuota" in str(err.value)
    assert apiserver.items("batch/v1", "jobs") == []  # no Job whose pods could never start
    assert apiserver.items("v1", "services") == []
    # Within the quota: created as usual.
    await backend.dispatch(gang_dispatch(job_id="fits", replicas=1))
    assert apiserver.get(f"{JOBS}/fits-a1-worker") is not None


async def test_api_servers_own_quota_refusal_reaches_the_broker_worded(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """A quota the agent's check does not cover (here: Services) still refuses at the API
    server; its 403 is passed on as a quota refusal, not as an agent error."""
    apiserver.put(NODES, node("n1"))
    apiserver.put(QUOTAS, quota("objects", {"services": "0"}, {"services": "0"}))
    backend, _ = await make_backend()
    with pytest.raises(JobRefused) as err:
        await backend.dispatch(gang_dispatch(replicas=1))
    text = str(err.value)
    assert "HTTP 403" in text and f"namespace {NS}:" in text
    assert (
        "exceeded quota: objects, requested: services=1, used: services=0, limited: services=0"
        in text
    )


async def test_broker_sees_the_dispatch_refused_with_the_quota_reason(
    apiserver: FakeApiServer, api_client: ApiClient, nc: Client
) -> None:
    """On the wire: the agent's CommandAck is a refusal naming the quota, which the broker
    takes as a failed placement on this cluster (DispatchAcked ok=False) and moves on."""
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    apiserver.put(QUOTAS, gpu_quota())
    cluster = unique("c")
    backend = KubeBackend(cluster, make_config(), api_client=api_client)
    wire = await BrokerWire(nc, cluster).start()
    runtime = AgentRuntime(backend, nc, heartbeat_s=0.2)
    await runtime.start()
    try:
        ack = await wire.send(gang_dispatch(replicas=2))
        assert not ack.ok
        assert GPU_OVER in ack.error
        assert ack.job_only  # the team's namespace is full, not the cluster's pool
        ack = await wire.send(
            dispatch(
                {
                    "name": "s",
                    "job_id": "small",
                    "gang": [{"name": "worker", "gpu": 4}],
                    "workload": {"image": "i", "command": ["c"]},
                },
                {"worker": ["n1"]},
                attempt=1,
            )
        )
        assert ack.ok, ack.error
    finally:
        await runtime.stop()
        await wire.stop()
        await backend.stop()


async def test_a_retried_dispatch_is_not_refused_for_its_own_usage(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    """After an agent restart the broker sends the unacknowledged dispatch again; the quota
    now counts that attempt's own pods, which must not make the agent refuse (and so end)
    the attempt that runs."""
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    apiserver.put(QUOTAS, gpu_quota("0"))
    cmd = gang_dispatch(replicas=2)
    first = KubeBackend("c1", make_config(), api_client=api_client)
    await first.start(Recorder())
    await first.dispatch(cmd)
    await first.stop()
    apiserver.put(QUOTAS, gpu_quota("8"))  # the quota controller counted the gang's pods
    second = KubeBackend("c1", make_config(), api_client=api_client)
    await second.start(Recorder())
    try:
        await second.dispatch(cmd)  # taken as the retry it is
        with pytest.raises(BackendError, match="exceeded quota"):
            await second.dispatch(gang_dispatch(job_id="other", replicas=1))
    finally:
        await second.stop()


async def test_dispatches_at_once_share_one_quota_read_each_judged_by_its_own_pods(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    """A burst's quota checks share the read that is on its way: one request of the agent's
    API budget for all of them, and each is still judged by its own pods."""
    apiserver.put(QUOTAS, gpu_quota())
    apiserver.latency_s = 0.05  # the read is still on its way when the others ask
    reads = QuotaReads(lambda: KubeRest(api_client, 30.0))
    small = attempt_usage(gang_dispatch(replicas=1), "nvidia.com/gpu")  # 4 GPUs: fits
    big = attempt_usage(gang_dispatch(replicas=2), "nvidia.com/gpu")  # 8: over
    answers = await asyncio.gather(*(reads.refusal(NS, u) for u in [small, big] * 10))
    assert answers[0::2] == [None] * 10
    assert answers[1::2] == [quota_message(NS, GPU_OVER)] * 10 and answers[1] is not None
    assert f"namespace {NS}: {GPU_OVER}" in answers[1] and "Raise the ResourceQuota" in answers[1]
    asked = [r for r in apiserver.requests if r[:2] == ("GET", QUOTAS)]
    assert len(asked) == reads.reads == 1
    # A check after the read is done reads again: nothing is cached past the burst.
    apiserver.put(QUOTAS, gpu_quota("0"))
    assert await reads.refusal(NS, big) is None
    assert reads.reads == 2


async def test_a_shared_quota_read_that_fails_fails_every_check_that_shared_it(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    """The API server's error on the shared list reaches each Dispatch that waited for it
    (each refused as it would have been alone), and the next check lists again."""
    apiserver.put(QUOTAS, gpu_quota())
    apiserver.latency_s = 0.05
    apiserver.fail_next("GET", QUOTAS, 500)
    reads = QuotaReads(lambda: KubeRest(api_client, 30.0))
    usage = attempt_usage(gang_dispatch(replicas=1), "nvidia.com/gpu")
    answers = await asyncio.gather(
        *(reads.refusal(NS, usage) for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(a, KubeApiError) and a.status == 500 for a in answers), answers
    assert reads.reads == 1
    assert await reads.refusal(NS, usage) is None  # listed again: 4 of 8 GPUs used, 4 asked
    assert reads.reads == 2
