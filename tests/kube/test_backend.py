"""KubeBackend against the fake API server (a stand-in; the client is real kubernetes-asyncio):
list/watch, 410 recovery, bookmarks, spot notices, GPU health, foreign pods, workloads."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from agents.backend import BackendError
from agents.kube.backend import KubeBackend
from agents.metrics import AgentMetrics
from agents.runtime import AgentRuntime
from kinds.base import ANN_CHECKPOINT, ANN_CHECKPOINT_REQUEST, LABEL_JOB
from schemas.agent import (
    MAX_GPUS_PER_NODE,
    CheckpointReport,
    GpuHealth,
    NodeGone,
    SpotNotice,
    WorkloadStatus,
)
from tests.kube.conftest import (
    NODES,
    NOW,
    NS,
    PODS,
    Recorder,
    caught_up,
    gang_dispatch,
    make_config,
    node,
    pod,
)
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.helpers import JOBS, job_pods, set_pod, upserts
from tests.support import wait_for


async def test_start_snapshot_flavors_and_foreign_pods(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1", provider_id="aws:///us-east-1a/i-1"))
    apiserver.put(NODES, node("n2", labels={"eks.amazonaws.com/capacityType": "ON_DEMAND"}))
    apiserver.put(NODES, node("n3", labels={"pool": "h100"}))  # no flavor: not reported
    apiserver.put("/api/v1/namespaces/team-a/pods", pod("a", "n1", "team-a", gpu=2, cpu="4"))
    apiserver.put(
        "/api/v1/namespaces/team-a/pods", pod("done", "n1", "team-a", gpu=8, phase="Succeeded")
    )
    backend, rec = await make_backend()
    snap = await backend.snapshot()
    assert [f.name for f in snap.flavors] == ["a100-spot", "a100-od"]
    by_name = {n.name: n for n in snap.nodes}
    assert set(by_name) == {"n1", "n2"}
    assert by_name["n1"].flavor == "a100-spot" and by_name["n2"].flavor == "a100-od"
    assert (by_name["n1"].other_gpu, by_name["n1"].other_cpu_milli) == (2, 4000)
    assert by_name["n1"].other_memory == 2**30
    assert by_name["n2"].other_gpu == 0 and by_name["n1"].gpu == 8
    assert rec.events == []  # nothing emitted before the snapshot is the news

    # A foreign pod appears, then finishes: usage follows.
    p = apiserver.put("/api/v1/namespaces/team-b/pods", pod("b", "n2", "team-b", gpu=1))
    await rec.wait_for(lambda: any(n.other_gpu == 1 for n in upserts(rec, "n2")))
    p = copy.deepcopy(p)
    p["status"]["phase"] = "Succeeded"  # it leaves the watch (field selector): DELETED
    apiserver.put("/api/v1/namespaces/team-b/pods", p)
    await rec.wait_for(lambda: upserts(rec, "n2")[-1].other_gpu == 0)
    # A pending pod bound to the node counts too; an unbound one does not.
    apiserver.put(
        "/api/v1/namespaces/team-b/pods", pod("c", "n2", "team-b", gpu=3, phase="Pending")
    )
    apiserver.put("/api/v1/namespaces/team-b/pods", pod("d", "", "team-b", gpu=5, phase="Pending"))
    await rec.wait_for(lambda: upserts(rec, "n2")[-1].other_gpu == 3)
    # A node disappears.
    apiserver.remove(f"{NODES}/n1")
    await rec.wait_for(lambda: any(e.node == "n1" for e in rec.of(NodeGone)))


@pytest.mark.parametrize(
    ("taint", "provider_id", "labels", "expected"),
    [
        ("aws-node-termination-handler/spot-itn", "aws:///us-east-1a/i-1", None, 120.0),
        ("karpenter.sh/disrupted", "aws:///us-east-1a/i-2", None, 120.0),
        (
            "cloud.google.com/impending-node-termination",
            "gce://p/us-central1-a/n",
            {"cloud.google.com/gke-spot": "true"},
            30.0,
        ),
        (
            "karpenter.sh/disrupted",
            "azure:///subscriptions/s/vm/0",
            {"kubernetes.azure.com/scalesetpriority": "spot"},
            30.0,
        ),
        ("node.kubernetes.io/out-of-service", "", None, 30.0),
    ],
)
async def test_spot_notice_per_provider(
    apiserver: FakeApiServer,
    make_backend: Any,
    taint: str,
    provider_id: str,
    labels: dict[str, str] | None,
    expected: float,
) -> None:
    raw = node("s1", labels=labels, provider_id=provider_id)
    apiserver.put(NODES, raw)
    backend, rec = await make_backend()
    tainted = copy.deepcopy(raw)
    tainted["spec"]["taints"] = [{"key": taint, "effect": "NoSchedule"}]
    apiserver.put(NODES, tainted)
    await rec.wait_for(lambda: rec.of(SpotNotice))
    (notice,) = rec.of(SpotNotice)
    assert notice.node == "s1" and notice.deadline == NOW + expected
    assert taint in notice.reason
    await rec.wait_for(lambda: upserts(rec, "s1") and upserts(rec, "s1")[-1].spot_deadline)
    # Once per node: another change while the taint stays emits no second notice.
    tainted["metadata"]["labels"]["extra"] = "1"
    apiserver.put(NODES, tainted)
    await caught_up(apiserver, backend)
    assert len(rec.of(SpotNotice)) == 1
    # The taint goes away (rebalance cancelled): cleared, and a new taint notifies again.
    apiserver.put(NODES, raw)
    await rec.wait_for(lambda: upserts(rec, "s1")[-1].spot_deadline is None)
    apiserver.put(NODES, tainted)
    await rec.wait_for(lambda: len(rec.of(SpotNotice)) == 2)


async def test_spot_deadline_configurable_and_condition_signal(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    raw = node("s1", provider_id="aws:///x")
    raw["status"]["conditions"].append(
        {"type": "cloud.google.com/impending-node-termination", "status": "True"}
    )
    apiserver.put(NODES, raw)
    backend, rec = await make_backend(spot_deadlines_s={"aws": 90})
    # Already signalled at start: in the snapshot and as a notice right after the lists.
    snap = await backend.snapshot()
    assert snap.nodes[0].spot_deadline == NOW + 90
    assert [n.deadline for n in rec.of(SpotNotice)] == [NOW + 90]


async def test_pod_disruption_target_means_node_notice(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(
        NODES,
        # graceful node shutdown: the kubelet reports the node NotReady while it ends pods
        node(
            "n1",
            provider_id="gce://p/z/n1",
            labels={"cloud.google.com/gke-spot": "true"},
            ready=False,
        ),
    )
    apiserver.put(
        NODES, node("n2", provider_id="gce://p/z/n2", labels={"cloud.google.com/gke-spot": "true"})
    )
    backend, rec = await make_backend()
    preempted = pod(
        "p",
        "n2",
        "team",
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
        ],
    )
    apiserver.put("/api/v1/namespaces/team/pods", preempted)
    shutting = pod(
        "q",
        "n1",
        "team",
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
        ],
    )
    apiserver.put("/api/v1/namespaces/team/pods", shutting)
    await caught_up(apiserver, backend)  # both pods were seen
    notices = rec.of(SpotNotice)
    assert [(n.node, n.deadline) for n in notices] == [("n1", NOW + 30)]
    assert "TerminationByKubelet" in notices[0].reason


async def test_gpu_health_events_only_on_explicit_faults(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    raw = node("g1")
    apiserver.put(NODES, raw)
    _, rec = await make_backend()
    degraded = copy.deepcopy(raw)
    degraded["status"]["allocatable"]["nvidia.com/gpu"] = "6"
    apiserver.put(NODES, degraded)  # a dip: nothing to say yet (debounced)
    xid = copy.deepcopy(raw)
    xid["status"]["conditions"].append(
        {"type": "SysLogsXIDError", "status": "True", "reason": "XID79", "message": "fell off bus"}
    )
    apiserver.put(NODES, xid)
    await rec.wait_for(lambda: rec.of(GpuHealth))
    (ev,) = rec.of(GpuHealth)
    assert (ev.healthy, ev.xid) == (0, 79) and "SysLogsXIDError" in ev.reason
    assert upserts(rec, "g1")[-1].gpu_healthy == 0
    apiserver.put(NODES, raw)
    await rec.wait_for(lambda: len(rec.of(GpuHealth)) == 2)
    assert rec.of(GpuHealth)[-1].healthy == 8
    assert upserts(rec, "g1")[-1].gpu_healthy is None


async def test_dispatch_creates_and_cancel_deletes(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, rec = await make_backend()
    cmd = gang_dispatch()
    await backend.dispatch(cmd)
    svc = apiserver.get(f"/api/v1/namespaces/{NS}/services/job-1-a1")
    job = apiserver.get(f"{JOBS}/job-1-a1-worker")
    assert svc is not None and job is not None
    assert job["metadata"]["labels"][LABEL_JOB] == "job-1"
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "a100"}
    assert rec.of(WorkloadStatus)[-1].phase == "created"
    # A retried dispatch (e.g. after an agent restart) finds the objects and succeeds.
    await backend.dispatch(cmd)
    pods = job_pods(apiserver, "job-1-a1-worker")
    await rec.wait_for(lambda: len(backend.attempt_pods("job-1", 1)) == 2)
    await backend.cancel("job-1", 1, "user asked")
    assert apiserver.get(f"{JOBS}/job-1-a1-worker") is None
    assert apiserver.get(f"/api/v1/namespaces/{NS}/services/job-1-a1") is None
    policies = {p for path, p in apiserver.deletes}
    assert policies == {"Background"}
    # Pods went with the Job (cascade), and a cancelled attempt reports nothing more.
    await wait_for(
        lambda: all(apiserver.get(f"{PODS}/{p['metadata']['name']}") is None for p in pods)
    )
    await caught_up(apiserver, backend)  # the agent saw the pods go
    assert [s.phase for s in rec.of(WorkloadStatus)] == ["created"]
    # Deleting what does not exist is not an error.
    await backend.cancel("job-1", None, "again")
    with pytest.raises(BackendError, match="flavor"):
        await backend.dispatch(msgspec.structs.replace(cmd, attempt=2, flavor="nope"))


async def test_no_phase_is_reported_before_the_dispatch_has_made_every_object(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """The broker reads "created" as the Dispatch carried out and asks a slow one again; the
    Job's watch must not report it while its Service still waits for the API server."""
    backend, rec = await make_backend()
    services = f"/api/v1/namespaces/{NS}/services"
    apiserver.fail_next("POST", services, 429, retry_after=1)  # APF: come back in a second
    carried_out = asyncio.create_task(backend.dispatch(gang_dispatch()))
    await wait_for(lambda: apiserver.get(f"{JOBS}/job-1-a1-worker") is not None)
    await caught_up(apiserver, backend)  # the Job's watch has seen it
    assert not carried_out.done() and apiserver.get(f"{services}/job-1-a1") is None
    assert rec.of(WorkloadStatus) == []
    await carried_out
    assert [(s.job_id, s.attempt, s.phase) for s in rec.of(WorkloadStatus)] == [
        ("job-1", 1, "created")
    ]


def job_lists(apiserver: FakeApiServer, job_id: str) -> list[str]:
    """The list requests that looked for one job's objects by its label."""
    wanted = f"{LABEL_JOB}={job_id}"
    return [
        path
        for method, path, query in apiserver.requests
        if method == "GET" and wanted in query.get("labelSelector", "").split(",")
    ]


async def test_deleting_attempts_lists_only_what_the_agent_cannot_know(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    first, _ = await make_backend()
    for job in ("job-1", "job-2"):
        await first.dispatch(gang_dispatch(job))
    # An attempt this agent made in full: its objects are all there is, so no list.
    await first.cancel("job-1", 1, "user asked")
    assert apiserver.get(f"{JOBS}/job-1-a1-worker") is None
    assert apiserver.get(f"/api/v1/namespaces/{NS}/services/job-1-a1") is None
    assert job_lists(apiserver, "job-1") == []
    assert first.counters["attempt_deletions{by=known}"] == 1
    # A create whose answer was an error may have made its object all the same (here the
    # API server made the Job and the answer was lost): the cancel lists, and finds it.
    made = copy.deepcopy(apiserver.get(f"{JOBS}/job-2-a1-worker"))
    assert made is not None
    for meta in (made["metadata"], made["metadata"]["annotations"]):
        for key, value in list(meta.items()):
            if isinstance(value, str) and "job-2" in value:
                meta[key] = value.replace("job-2", "job-3")
    made["metadata"]["labels"] = {
        k: v.replace("job-2", "job-3") for k, v in made["metadata"]["labels"].items()
    }
    apiserver.fail_next("POST", JOBS, 500)
    with pytest.raises(BackendError):
        await first.dispatch(gang_dispatch("job-3"))
    apiserver.put(JOBS, made)
    await first.cancel("job-3", 1, "user asked")
    assert apiserver.get(f"{JOBS}/job-3-a1-worker") is None
    assert len(job_lists(apiserver, "job-3")) > 1
    # A new agent instance (a restart) did not make job-2: it lists every kind.
    second, _ = await make_backend()
    await second.cancel("job-2", 1, "user asked")
    assert apiserver.get(f"{JOBS}/job-2-a1-worker") is None
    assert apiserver.get(f"/api/v1/namespaces/{NS}/services/job-2-a1") is None
    assert len(job_lists(apiserver, "job-2")) > 1
    assert second.counters["attempt_deletions{by=listed}"] == 1
    # Once it has scanned, no attempt unknown to it exists: a job moved here from another
    # cluster at attempt 2 has no older attempt here to list for.
    assert await second.collect_garbage() == 0
    await second.dispatch(gang_dispatch("job-4", attempt=2))
    await wait_for(lambda: second.counters.get("attempt_deletions{by=known}") == 1)
    assert job_lists(apiserver, "job-4") == []
    assert apiserver.get(f"{JOBS}/job-4-a2-worker") is not None


async def test_foreground_propagation_and_gc_of_older_attempts(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, _ = await make_backend(delete_propagation="Foreground")
    await backend.dispatch(gang_dispatch(attempt=1))
    await backend.dispatch(gang_dispatch(attempt=2))
    await wait_for(lambda: apiserver.get(f"{JOBS}/job-1-a1-worker") is None)
    assert apiserver.get(f"{JOBS}/job-1-a2-worker") is not None
    assert all(p == "Foreground" for _, p in apiserver.deletes)
    # An object left behind by an older agent instance is collected by the periodic GC.
    stale = copy.deepcopy(apiserver.get(f"{JOBS}/job-1-a2-worker"))
    assert stale is not None
    stale["metadata"] = {
        "name": "old-copy",
        "labels": {**stale["metadata"]["labels"], "muster.dev/attempt": "1"},
        "annotations": stale["metadata"]["annotations"],
    }
    apiserver.put(JOBS, stale)
    assert await backend.collect_garbage() == 1
    assert apiserver.get(f"{JOBS}/old-copy") is None


async def test_workload_status_running_succeeded(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch())
    pods = job_pods(apiserver, "job-1-a1-worker", "Pending", ("n1", "n2"))
    set_pod(apiserver, pods[0], phase="Running")
    await caught_up(apiserver, backend)
    assert [s.phase for s in rec.of(WorkloadStatus)] == ["created"]  # 1 of 2 is not running
    pods[1] = set_pod(apiserver, pods[1], phase="Running")
    await rec.wait_for(lambda: rec.of(WorkloadStatus)[-1].phase == "running")
    st = rec.of(WorkloadStatus)[-1]
    assert (st.running_replicas, st.total_replicas, st.nodes) == (2, 2, ["n1", "n2"])
    # Muster's own pods are not "other" usage on their nodes.
    assert all(n.other_gpu == 0 for n in (await backend.snapshot()).nodes)
    for p in pods:
        set_pod(apiserver, p, phase="Succeeded")
    await rec.wait_for(lambda: rec.of(WorkloadStatus)[-1].phase == "succeeded")
    assert [s.phase for s in rec.of(WorkloadStatus)] == ["created", "running", "succeeded"]
    snap = await backend.snapshot()
    assert [(w.job_id, w.attempt, w.phase) for w in snap.workloads] == [("job-1", 1, "succeeded")]


async def test_workload_failed_with_exit_codes(apiserver: FakeApiServer, make_backend: Any) -> None:
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch())
    pods = job_pods(apiserver, "job-1-a1-worker", "Running", ("n1", "n2"))
    terminated = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    set_pod(
        apiserver,
        pods[1],
        phase="Failed",
        containerStatuses=[{"name": "trainer", "state": terminated}],
    )
    await rec.wait_for(lambda: rec.of(WorkloadStatus)[-1].phase == "failed")
    st = rec.of(WorkloadStatus)[-1]
    assert st.exit_codes == [137] and "OOMKilled" in st.reason


@pytest.mark.parametrize("cause", ["node", "preempted", "deleted"])
async def test_workload_evicted_with_cause(
    apiserver: FakeApiServer, make_backend: Any, cause: str
) -> None:
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch())
    pods = job_pods(apiserver, "job-1-a1-worker", "Running", ("n1", "n2"))
    if cause == "node":
        apiserver.remove(f"{NODES}/n2")
        expected = "node gone: n2"
    elif cause == "preempted":
        cond = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
        set_pod(apiserver, pods[0], phase="Failed", conditions=cond)
        expected = "preempted"
    else:
        apiserver.remove(f"{PODS}/{pods[0]['metadata']['name']}")
        expected = "pod deleted"
    await rec.wait_for(lambda: rec.of(WorkloadStatus)[-1].phase == "evicted")
    assert expected in rec.of(WorkloadStatus)[-1].reason


async def test_checkpoint_annotation_and_request(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch())
    pods = job_pods(apiserver, "job-1-a1-worker", "Running", ("n1", "n2"))

    def annotate(value: str) -> None:
        p = copy.deepcopy(apiserver.get(f"{PODS}/{pods[0]['metadata']['name']}"))
        assert p is not None
        p["metadata"]["annotations"][ANN_CHECKPOINT] = value
        apiserver.put(PODS, p)

    annotate(json.dumps({"step": 100, "uri": "s3://b/job-1/100"}))
    await rec.wait_for(lambda: rec.of(CheckpointReport))
    annotate("{not json")
    annotate(json.dumps({"step": 100, "uri": "s3://b/job-1/100"}))
    annotate(json.dumps({"step": 200, "uri": "s3://b/job-1/200"}))
    await rec.wait_for(lambda: len(rec.of(CheckpointReport)) == 2)
    reports = rec.of(CheckpointReport)
    assert [(r.job_id, r.attempt, r.step, r.uri, r.at) for r in reports] == [
        ("job-1", 1, 100, "s3://b/job-1/100", NOW),
        ("job-1", 1, 200, "s3://b/job-1/200", NOW),
    ]
    await backend.checkpoint_now("job-1", 1, NOW + 30)
    patched = {path.rsplit("/", 1)[1] for path, _, _ in apiserver.patches}
    assert patched == {p["metadata"]["name"] for p in pods}
    stored = apiserver.get(f"{PODS}/{pods[1]['metadata']['name']}")
    assert stored is not None
    assert stored["metadata"]["annotations"][ANN_CHECKPOINT_REQUEST] == f"{NOW + 30:.3f}"
    assert all(ctype == "application/merge-patch+json" for _, ctype, _ in apiserver.patches)
    await backend.checkpoint_now("job-404", 1, NOW)  # nothing to ask: no error


@pytest.mark.parametrize("as_http", [False, True])
async def test_410_gone_relists_and_state_is_correct(
    apiserver: FakeApiServer, make_backend: Any, as_http: bool
) -> None:
    apiserver.gone_as_http = as_http
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    backend, rec = await make_backend()
    nr = backend.node_reflector
    assert nr is not None
    await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
    # Changes the watch never sees (made "while away", then the history is compacted).
    apiserver.remove(f"{NODES}/n2", silent=True)
    apiserver.put(NODES, node("n3"), silent=True)
    if as_http:
        apiserver.compact()
        apiserver.close_watches("nodes")  # the reconnect with the old version gets HTTP 410
    else:
        apiserver.expire_watches()  # open watches get an ERROR 410 event
    await rec.wait_for(lambda: nr.gone >= 1 and nr.lists >= 2)
    await rec.wait_for(lambda: any(e.node == "n2" for e in rec.of(NodeGone)))
    await rec.wait_for(lambda: upserts(rec, "n3"))
    assert {n.name for n in (await backend.snapshot()).nodes} == {"n1", "n3"}
    # And the new watch carries on from the re-list.
    apiserver.put(NODES, node("n4"))
    await rec.wait_for(lambda: upserts(rec, "n4"))


async def test_bookmarks_advance_resource_version(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, _ = await make_backend()
    pr = backend.pod_reflector
    assert pr is not None
    await _wait(lambda: apiserver.watch_count("pods") == 2)  # every pod, and Muster's own
    start_rv = pr.resource_version
    for i in range(3):
        apiserver.put(NODES, node(f"x{i}", labels={"pool": "none"}))
    apiserver.bookmark()
    await _wait(lambda: pr.bookmarks == 1)
    assert int(pr.resource_version) == apiserver.rv > int(start_rv)
    assert pr.events == 0
    q = [q for m, p, q in apiserver.requests if p == "/api/v1/pods" and q.get("watch") == "true"]
    assert q[0]["allowWatchBookmarks"] == "true" and q[0]["resourceVersion"] == start_rv


async def test_garbage_lines_and_watch_errors_do_not_crash(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    backend, rec = await make_backend()
    nr = backend.node_reflector
    assert nr is not None
    await _wait(lambda: apiserver.watch_count("nodes") == 1)
    apiserver.send_raw(b"this is not json\n", "nodes")
    apiserver.send_raw(b'{"type":"ADDED","object":{"metadata":["wrong"]}}\n', "nodes")
    apiserver.send_raw(
        b'{"type":"ADDED","object":{"metadata":{"name":"n9"},"new":{"x":1}}}\n', "nodes"
    )
    apiserver.send_raw(b'{"kind":"Status","code":500}\n', "nodes")
    apiserver.put(NODES, node("n2"))
    await rec.wait_for(lambda: upserts(rec, "n2"))
    assert nr.bad_lines >= 3
    # A failing list after a 410 is retried with backoff, not fatal.
    apiserver.fail_next("GET", "/api/v1/nodes", 500)
    apiserver.fail_next("GET", "/api/v1/nodes", 503)
    apiserver.expire_watches()
    apiserver.put(NODES, node("n3"))
    await rec.wait_for(lambda: upserts(rec, "n3"), timeout=10)
    assert nr.errors >= 2


async def test_restart_rediscovers_workloads_and_skips_missing_crds(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any
) -> None:
    apiserver.missing_groups = {"jobset.x-k8s.io", "batch.volcano.sh"}
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    first = KubeBackend("c1", make_config(), api_client=api_client, clock=lambda: NOW)
    await first.start(Recorder())
    await first.dispatch(gang_dispatch())
    await first.stop()
    job_pods(apiserver, "job-1-a1-worker", "Running", ("n1", "n2"))
    backend, rec = await make_backend()
    snap = await backend.snapshot()
    assert [(w.job_id, w.attempt, w.phase, w.total_replicas) for w in snap.workloads] == [
        ("job-1", 1, "running", 2)
    ]
    assert not rec.of(WorkloadStatus)  # the snapshot carries it; no delta


async def _wait(pred: Any, timeout: float = 5.0) -> None:
    await Recorder().wait_for(pred, timeout)


async def test_gpu_count_above_the_schema_bound_is_clamped_and_counted(
    apiserver: FakeApiServer, make_backend: Any, nc: Client
) -> None:
    """One node with a bogus GPU count must not get the whole snapshot refused."""
    bound = MAX_GPUS_PER_NODE
    apiserver.put(NODES, node("ok"))
    apiserver.put(
        NODES,
        node(
            "bogus",
            labels={"karpenter.sh/capacity-type": "spot", "nvidia.com/gpu.count": "99999"},
            gpu=bound + 5,
        ),
    )
    backend, _ = await make_backend()
    snap = await backend.snapshot()
    by_name = {n.name: n for n in snap.nodes}
    assert by_name["ok"].gpu == 8
    assert by_name["bogus"].gpu == bound
    snap = msgspec.json.decode(msgspec.json.encode(snap), type=type(snap))  # passes the schema
    reason = "GPU count above the schema bound"
    assert backend.counters[f"bad_input{{kind=Node,reason={reason}}}"] >= 1
    # ... and exported by the agent's metrics endpoint.
    registry = AgentMetrics(lambda: {"c1": AgentRuntime(backend, nc)}).registry
    labels = {"cluster": "c1", "kind": "Node", "reason": reason}
    assert (registry.get_sample_value("muster_agent_bad_input_total", labels) or 0) >= 1


async def test_service_is_owned_by_its_indexed_job_and_goes_with_it(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, _ = await make_backend()
    svc_path = f"/api/v1/namespaces/{NS}/services/job-1-a1"
    await backend.dispatch(gang_dispatch())
    job, svc = apiserver.get(f"{JOBS}/job-1-a1-worker"), apiserver.get(svc_path)
    assert job is not None and svc is not None
    expected = [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "job-1-a1-worker",
            "uid": job["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert svc["metadata"]["ownerReferences"] == expected
    # A retried dispatch that finds the Job (409) reads its uid for a missing Service.
    apiserver.remove(svc_path)
    await backend.dispatch(gang_dispatch())
    svc = apiserver.get(svc_path)
    assert svc is not None and svc["metadata"]["ownerReferences"] == expected
    # Deleting the Job alone collects the Service (garbage collection by owner).
    await backend.rest.delete(f"{JOBS}/job-1-a1-worker", "Background")
    assert apiserver.get(svc_path) is None
