"""Workload namespaces per team (or per queue): a job runs in the namespace its queue maps to,
where the team's own Secrets, ConfigMaps and PVCs are; the agent may act there only where a
RoleBinding of the shipped deploy grants it (deploy/agent/team-namespace.yaml)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import yaml

from agents.backend import BackendError
from agents.kube.backend import KubeBackend
from agents.kube.config import REPORT_PORT as BASE_REPORT_PORT
from agents.kube.config import KubeConfigError, convert_kube_config
from schemas.agent import WorkloadStatus
from tests.kube.conftest import (
    BASE_CONFIG,
    NODES,
    NS,
    Recorder,
    dispatch,
    make_config,
    node,
    run_job_pod,
)
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.manifests import BATCH_JOB_YAML
from tests.kube.rbac_authz import RbacAuthorizer
from tests.support import DEPLOY

TEMPLATE = DEPLOY / "agent" / "team-namespace.yaml"
TEAMS = [{"namespace": "team-a", "queues": ["research", "research-urgent"]}]


def team_docs(namespace: str) -> list[dict[str, Any]]:
    """The shipped template, made for `namespace` as its header says (replace team-a)."""
    text = TEMPLATE.read_text().replace("team-a", namespace)
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def job(job_id: str, queue: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "ddp",
        "job_id": job_id,
        "gang": [{"name": "worker", "replicas": 1, "gpu": 4}],
        "workload": {
            "image": "trainer:1",
            "command": ["python", "train.py"],
            "secret_env": {"HF_TOKEN": {"name": "hf", "key": "token"}},
        },
    }
    return {**spec, "queue": queue} if queue else spec


def test_queue_maps_to_its_namespace_and_the_rest_to_the_default() -> None:
    cfg = convert_kube_config({**BASE_CONFIG, "namespaces": TEAMS})
    assert cfg.namespace_for("research-urgent") == "team-a"
    assert cfg.namespace_for("other") == NS
    assert cfg.namespace_for(None) == NS
    assert cfg.workload_namespaces() == [NS, "team-a"]


def test_a_queue_mapped_twice_is_refused_with_the_queue_named() -> None:
    twice = [*TEAMS, {"namespace": "team-b", "queues": ["research"]}]
    with pytest.raises(KubeConfigError, match=r"\['research'\] are mapped more than once"):
        convert_kube_config({**BASE_CONFIG, "namespaces": twice})


async def test_team_job_runs_in_its_namespace_with_its_own_secrets(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.authorizer = RbacAuthorizer.shipped(*team_docs("team-a"))
    apiserver.put(NODES, node("n1"))
    backend, rec = await make_backend(namespaces=TEAMS)
    await backend.dispatch(dispatch(job("team-1", "research"), {"worker": ["n1"]}, attempt=1))
    await backend.dispatch(dispatch(job("shared-1"), {"worker": ["n1"]}, attempt=1))
    team_job = apiserver.get("/apis/batch/v1/namespaces/team-a/jobs/team-1-a1-worker")
    assert team_job is not None
    assert apiserver.get(f"/apis/batch/v1/namespaces/{NS}/jobs/team-1-a1-worker") is None
    assert apiserver.get(f"/apis/batch/v1/namespaces/{NS}/jobs/shared-1-a1-worker") is not None
    # The Secret is looked up by the kubelet in the pod's own namespace: the team's.
    env = team_job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in [
        {k: v for k, v in e.items() if k in ("name", "valueFrom")} for e in env
    ]
    # Its pods report from the team's namespace; a look-alike elsewhere reports nothing.
    run_job_pod(apiserver, "team-1-a1-worker", "n1", namespace="team-a")
    await rec.wait_for(
        lambda: any(s.job_id == "team-1" and s.phase == "running" for s in rec.of(WorkloadStatus))
    )
    await backend.checkpoint_now("team-1", 1, 1.0)
    (pod,) = [p for p in apiserver.items("v1", "pods") if p["metadata"]["namespace"] == "team-a"]
    assert "muster.dev/checkpoint-request" in pod["metadata"]["annotations"]
    await backend.cancel("team-1", None, "test")
    gone = apiserver.get("/apis/batch/v1/namespaces/team-a/jobs/team-1-a1-worker")
    assert gone is None or gone["metadata"].get("deletionTimestamp")
    assert apiserver.forbidden == []


async def test_namespace_without_the_rolebinding_is_refused_with_the_403(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    teams = [{"namespace": "team-b", "queues": ["vision"]}]
    backend, _ = await make_backend(namespaces=teams)
    with pytest.raises(BackendError, match=r'cannot create resource "jobs".*"team-b"'):
        await backend.dispatch(dispatch(job("b-1", "vision"), {"worker": ["n1"]}, attempt=1))
    assert apiserver.forbidden, "the stand-in granted a namespace no shipped binding covers"
    assert msgspec.json.decode(msgspec.json.encode(apiserver.forbidden[-1]))["code"] == 403


def test_team_template_opens_the_report_port_to_the_team_only() -> None:
    """Pods of a team namespace post checkpoint reports to the agent as the default
    namespace's do: the template's NetworkPolicy admits that namespace, on that port."""
    (policy,) = [d for d in team_docs("team-x") if d["kind"] == "NetworkPolicy"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-x"}}}
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": BASE_REPORT_PORT}]
    assert policy["metadata"]["namespace"] == "muster-system"


async def test_fence_watchdog_vouches_only_for_its_own_namespace(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """The watchdog lists and deletes in the default namespace only: an attempt in a team's
    namespace is not fenced by the cluster, so the agent fences it itself when cut off."""
    apiserver.authorizer = RbacAuthorizer.shipped(*team_docs("team-a"))
    apiserver.put(NODES, node("n1"))
    backend, _ = await make_backend(namespaces=TEAMS, fence_watchdog=True)
    for job_id, queue in (("team-1", "research"), ("shared-1", None)):
        cmd = dispatch(job(job_id, queue), {"worker": ["n1"]}, attempt=1, fence_after_s=20.0)
        await backend.dispatch(cmd)
    assert backend.fences("shared-1", 1)
    assert not backend.fences("team-1", 1)


async def test_a_restarted_agent_finds_and_follows_a_team_attempt(
    apiserver: FakeApiServer, api_client: Any
) -> None:
    """Objects and pods in a team's namespace are found again by the next agent (the startup
    scan and the watches cover every listed namespace), which then reports and cancels there."""
    apiserver.authorizer = RbacAuthorizer.shipped(*team_docs("team-a"))
    apiserver.put(NODES, node("n1"))
    first = KubeBackend("c1", make_config(namespaces=TEAMS), api_client=api_client)
    await first.start(Recorder())
    await first.dispatch(dispatch(job("team-1", "research"), {"worker": ["n1"]}, attempt=1))
    await first.stop()
    run_job_pod(apiserver, "team-1-a1-worker", "n1", namespace="team-a")
    second = KubeBackend("c1", make_config(namespaces=TEAMS), api_client=api_client)
    rec = Recorder()
    await second.start(rec)
    try:
        snap = await second.snapshot()
        assert [(w.job_id, w.phase) for w in snap.workloads] == [("team-1", "running")]
        assert second.namespace_of(("team-1", 1)) == "team-a"
        await second.cancel("team-1", None, "test")
        gone = apiserver.get("/apis/batch/v1/namespaces/team-a/jobs/team-1-a1-worker")
        assert gone is None or gone["metadata"].get("deletionTimestamp")
    finally:
        await second.stop()
    assert apiserver.forbidden == []


async def test_the_queue_decides_the_namespace_not_the_manifest(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """A manifest naming another team's namespace still runs in its own queue's: a job cannot
    reach team-a's Secrets by writing `metadata.namespace: team-a`."""
    apiserver.authorizer = RbacAuthorizer.shipped(*team_docs("team-a"))
    apiserver.put(NODES, node("n1"))
    backend, _ = await make_backend(namespaces=TEAMS)
    manifest = yaml.safe_load(BATCH_JOB_YAML)
    manifest["metadata"]["namespace"] = "team-a"
    spec = {"name": "m", "job_id": "sneaky", "workload": {"kind": "manifest", "manifest": manifest}}
    await backend.dispatch(dispatch(spec, {}, attempt=1))
    jobs = {
        (j["metadata"]["namespace"], j["metadata"]["name"])
        for j in apiserver.items("batch/v1", "jobs")
    }
    assert {ns for ns, _ in jobs} == {NS}
