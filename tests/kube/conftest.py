"""Fixtures for the kube backend: the fake API server (a stand-in, see fake_apiserver.py), a
real kubernetes-asyncio ApiClient pointed at it, and builders for Node/Pod objects."""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest_asyncio
import yaml
from kubernetes_asyncio.client import ApiClient, Configuration

from agents.kube.backend import KubeBackend
from agents.kube.config import KubeBackendConfig, convert_kube_config
from schemas.agent import AgentEvent, Dispatch, PodSetAssignment
from schemas.job import JobSpec
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.rbac_authz import AGENT_USER, RbacAuthorizer
from tests.support import wait_for

NODES = "/api/v1/nodes"
NS = "muster-workloads"
PODS = f"/api/v1/namespaces/{NS}/pods"
NOW = 1_000_000.0

BASE_CONFIG: dict[str, Any] = {
    "namespace": NS,
    "flavors": [
        {
            "name": "a100-spot",
            "capacity_type": "spot",
            "gpu_type": "a100",
            "price_per_gpu_hour": 1.2,
            "node_labels": {"pool": "a100"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
        },
        {
            "name": "a100-od",
            "capacity_type": "on-demand",
            "gpu_type": "a100",
            "price_per_gpu_hour": 3.5,
            "node_labels": {"pool": "a100"},
        },
    ],
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.2,
    "watch_timeout_s": 30,
    # The checkpoint report endpoint on loopback, a free port, its own address as the URL.
    "report": {"listen_host": "127.0.0.1", "listen_port": 0, "url": ""},
}


def make_config(**overrides: Any) -> KubeBackendConfig:
    return convert_kube_config({**BASE_CONFIG, **overrides})


def node(
    name: str,
    labels: dict[str, str] | None = None,
    gpu: int = 8,
    allocatable_gpu: int | None = None,
    taints: list[dict[str, str]] | None = None,
    conditions: list[dict[str, str]] | None = None,
    provider_id: str = "",
    ready: bool = True,
) -> dict[str, Any]:
    """A Node as the API server returns it, with noise (managedFields, images) included.
    Without `labels` it is a Karpenter spot node of pool a100."""
    if labels is None:
        labels = {"karpenter.sh/capacity-type": "spot"}
    alloc = gpu if allocatable_gpu is None else allocatable_gpu
    conds = [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}]
    return {
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "pool": "a100", **labels},
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {"providerID": provider_id, "taints": taints or []},
        "status": {
            "capacity": {
                "cpu": "96",
                "memory": "1024Gi",
                "nvidia.com/gpu": str(gpu),
                "pods": "110",
            },
            "allocatable": {
                "cpu": "95500m",
                "memory": "1000Gi",
                "nvidia.com/gpu": str(alloc),
                "pods": "110",
            },
            "conditions": conds + (conditions or []),
            "images": [{"names": ["x"], "sizeBytes": 1}],
        },
    }


def pod(
    name: str,
    node_name: str,
    namespace: str = "default",
    gpu: int = 0,
    cpu: str = "1",
    memory: str = "1Gi",
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    conditions: list[dict[str, str]] | None = None,
    container_statuses: list[dict[str, Any]] | None = None,
    reason: str = "",
) -> dict[str, Any]:
    requests: dict[str, str] = {"cpu": cpu, "memory": memory}
    limits: dict[str, str] = {"nvidia.com/gpu": str(gpu)} if gpu else {}
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": {
            "nodeName": node_name,
            "containers": [
                {
                    "name": "main",
                    "image": "x",
                    "resources": {"requests": requests, "limits": limits},
                }
            ],
        },
        "status": {
            "phase": phase,
            "reason": reason,
            "conditions": conditions or [],
            "containerStatuses": container_statuses or [],
        },
    }


def job_owner(job: dict[str, Any]) -> dict[str, Any]:
    """The ownerReference the Job controller puts on the pods it creates."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": job["metadata"]["name"],
        "uid": job["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def run_job_pod(
    server: FakeApiServer,
    job_name: str,
    node_name: str,
    index: int = 0,
    namespace: str = NS,
    phase: str = "Running",
) -> Any:
    """What the Job controller, scheduler and kubelet make of a Muster Job: a Running pod
    (or one in `phase`)."""
    job = server.get(f"/apis/batch/v1/namespaces/{namespace}/jobs/{job_name}")
    assert job is not None
    tmpl = job["spec"]["template"]["metadata"]
    p = pod(f"{job_name}-{index}-x", node_name, namespace=namespace, gpu=4, phase=phase)
    p["metadata"]["labels"] = copy.deepcopy(tmpl["labels"])
    p["metadata"]["annotations"] = copy.deepcopy(tmpl.get("annotations") or {})
    p["metadata"]["ownerReferences"] = [job_owner(job)]
    return server.put(f"/api/v1/namespaces/{namespace}/pods", p)


class Clock:
    """A clock the test moves: timers (debounce, grace) are driven, never waited for."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rfc3339(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


class Recorder:
    """Collects emitted events; `wait_for` polls (bounded) until a predicate holds."""

    def __init__(self) -> None:
        self.events: list[AgentEvent] = []

    def __call__(self, ev: AgentEvent) -> None:
        self.events.append(ev)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    async def wait_for(self, pred: Callable[[], object], timeout: float = 5.0) -> None:
        try:
            await wait_for(pred, timeout)
        except AssertionError:
            raise AssertionError(f"timed out; events: {self.events[-10:]}") from None


async def caught_up(server: FakeApiServer, backend: KubeBackend, timeout: float = 5.0) -> None:
    """Wait until every watch of `backend` has handled everything the server has done so far:
    each reflector's resourceVersion reaches the server's (handlers run before it advances).
    A BOOKMARK carries the version to a watch whose own collection did not change last. This
    is the positive marker before asserting that a change led to nothing."""
    rv = server.rv
    reflectors = [
        r
        for r in (
            backend.node_reflector,
            backend.pod_reflector,
            backend.muster_pod_reflector,
            *backend.job_reflectors.values(),
            *(backend.autoscaling.reflectors if backend.autoscaling else ()),
        )
        if r is not None and not r.absent
    ]

    def done() -> bool:
        if all(int(r.resource_version or 0) >= rv for r in reflectors):
            return True
        server.bookmark()
        return False

    await wait_for(done, timeout, what=f"every watch at resourceVersion {rv}", interval=0.02)


# Validate what the agent creates and updates as a real API server would (422 otherwise).
VALIDATE_WRITES = True
# The agent's token: the stand-in authorizes it as the shipped muster-agent service account.
AGENT_TOKEN = "muster-agent-token"


def enforce_shipped_rbac(server: FakeApiServer) -> None:
    """Authorize every request against deploy/agent/'s RBAC as the agent's service account
    (a test that plays another identity maps its token in `server.users`)."""
    server.authorizer = RbacAuthorizer.shipped()
    server.users[AGENT_TOKEN] = AGENT_USER
    server.default_user = AGENT_USER


@pytest_asyncio.fixture
async def apiserver() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(validate=VALIDATE_WRITES)
    enforce_shipped_rbac(server)
    await server.start()
    yield server
    await server.close()


@pytest_asyncio.fixture
async def api_client(apiserver: FakeApiServer) -> AsyncIterator[ApiClient]:
    cfg = Configuration(host=apiserver.url)
    cfg.api_key["BearerToken"] = f"Bearer {AGENT_TOKEN}"
    client = ApiClient(configuration=cfg)
    yield client
    await client.close()


@pytest_asyncio.fixture
async def make_backend(
    api_client: ApiClient,
) -> AsyncIterator[Callable[..., Any]]:
    """`await make_backend(**config overrides)` -> (started backend, recorder)."""
    made: list[KubeBackend] = []

    async def factory(
        clock: Callable[[], float] = lambda: NOW, tick_s: float = 1.0, **overrides: Any
    ) -> tuple[KubeBackend, Recorder]:
        backend = KubeBackend(
            "c1", make_config(**overrides), api_client=api_client, clock=clock, tick_s=tick_s
        )
        rec = Recorder()
        await backend.start(rec)
        made.append(backend)
        return backend, rec

    yield factory
    for b in made:
        await b.stop()


# -- Dispatch commands as the broker sends them ---------------------------------------------


def dispatch(
    spec: dict[str, Any], assignment: dict[str, list[str]], attempt: int = 2, **kw: Any
) -> Dispatch:
    return Dispatch(
        job_id=spec.get("job_id", "job-1"),
        attempt=attempt,
        epoch=1,
        flavor="a100-spot",
        assignment=[PodSetAssignment(podset=k, nodes=v) for k, v in assignment.items()],
        spec=msgspec.convert(spec, JobSpec),
        **kw,
    )


def manifest_dispatch(
    text: str,
    assignment: dict[str, list[str]] | None = None,
    *,
    job_id: str = "m-1",
    attempt: int = 5,
) -> Dispatch:
    """A job whose workload is a user's manifest (YAML text)."""
    spec = {
        "name": "m",
        "job_id": job_id,
        "workload": {"kind": "manifest", "manifest": yaml.safe_load(text)},
    }
    return dispatch(spec, assignment or {}, attempt=attempt)


def gang_dispatch(job_id: str = "job-1", attempt: int = 1, replicas: int = 2) -> Dispatch:
    """A Muster gang of `replicas` 4-GPU workers on nodes n1..n<replicas>."""
    spec = {
        "name": "ddp",
        "job_id": job_id,
        "gang": [{"name": "worker", "replicas": replicas, "gpu": 4}],
        "workload": {"image": "trainer:1", "command": ["python", "train.py"]},
    }
    return dispatch(spec, {"worker": [f"n{i}" for i in range(1, replicas + 1)]}, attempt)
