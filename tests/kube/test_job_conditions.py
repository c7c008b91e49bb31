"""Job-level verdicts and in-place container restarts.

Pure parts (`status.job_verdict`, `status.restarts`, `Workload` with object verdicts,
`decode.decode_job_status`, `decode.decode_list_lenient`) are tested directly; the backend is
tested against the fake API server (a stand-in, see fake_apiserver.py; the client is the real
kubernetes-asyncio) by what it emits."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.kube.decode import (
    KJob,
    KJobStatus,
    KPod,
    decode_job_status,
    decode_list_lenient,
)
from agents.kube.status import (
    STATUS_RESOURCES,
    Workload,
    classify,
    job_verdict,
)
from kinds.base import ANN_JOB, LABEL_ATTEMPT, LABEL_JOB, LABEL_TOP
from kinds.batch import BATCH_JOB
from kinds.jobset import JobSet
from kinds.pods import selector
from kinds.registry import adapter_for
from kinds.volcano import VolcanoJob
from schemas.agent import NodeUpsert, WorkloadStatus
from tests.kube.conftest import (
    NODES,
    NS,
    PODS,
    Recorder,
    caught_up,
    gang_dispatch,
    manifest_dispatch,
    node,
    pod,
)
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.manifests import (
    JOBSET_YAML,
    MPIJOB_YAML,
    PYTORCHJOB_YAML,
    TFJOB_YAML,
    VOLCANO_YAML,
)
from tests.support import wait_for

JOBSET = JobSet.resource
VOLCANO_JOB = VolcanoJob.resource
PYTORCHJOB = adapter_for("kubeflow.org/v1", "PyTorchJob").resource
TFJOB = adapter_for("kubeflow.org/v1", "TFJob").resource
MPIJOB = adapter_for("kubeflow.org/v2beta1", "MPIJob").resource

PYTORCHJOBS = PYTORCHJOB.collection(NS)
BATCH_JOBS = BATCH_JOB.collection(NS)
FAILED_BACKOFF = {
    "type": "Failed",
    "status": "True",
    "reason": "BackoffLimitExceeded",
    "message": "PyTorchJob job-1-a1 is failed because 1 Worker replica(s) failed.",
}


# -- helpers --------------------------------------------------------------------------------


async def running_indexed_job(
    apiserver: FakeApiServer, backend: Any, rec: Recorder
) -> list[dict[str, Any]]:
    """Dispatch a 2-replica gang (an Indexed Job) and run its pods, as the Job controller and
    kube-scheduler would; returns the pods once the attempt reported running."""
    await backend.dispatch(gang_dispatch())
    job = apiserver.get(f"{BATCH_JOBS}/job-1-a1-worker")
    assert job is not None
    tmpl = job["spec"]["template"]["metadata"]
    made = []
    for i in range(2):
        p = pod(f"job-1-a1-worker-{i}-x", f"n{i + 1}", namespace=NS, gpu=4)
        p["metadata"].update(labels=tmpl["labels"], annotations=tmpl["annotations"])
        made.append(apiserver.put(PODS, p))
    await rec.wait_for(lambda: phases(rec) == ["created", "running"])
    return made


def set_status(server: FakeApiServer, collection: str, name: str, status: Any) -> None:
    """What the operator does: write the object's status (a MODIFIED event)."""
    obj = copy.deepcopy(server.get(f"{collection}/{name}"))
    assert obj is not None, name
    obj["status"] = status
    server.put(collection, obj)


def kubeflow_pods(
    server: FakeApiServer, name: str = "job-1-a1", phase: str = "Running"
) -> dict[str, dict[str, Any]]:
    """What the Training Operator and the scheduler would create for a PyTorchJob."""
    job = server.get(f"{PYTORCHJOBS}/{name}")
    assert job is not None
    out: dict[str, dict[str, Any]] = {}
    i = 0
    for rtype, rs in job["spec"]["pytorchReplicaSpecs"].items():
        tmpl = rs["template"]["metadata"]
        for index in range(rs["replicas"]):
            i += 1
            pname = f"{name}-{rtype.lower()}-{index}"
            p = pod(pname, f"n{i}", namespace=NS, gpu=2, phase=phase)
            p["metadata"]["labels"] = copy.deepcopy(tmpl["labels"])
            p["metadata"]["annotations"] = copy.deepcopy(tmpl["annotations"])
            p["status"]["containerStatuses"] = [
                {"name": "pytorch", "restartCount": 0, "state": {"running": {}}}
            ]
            out[pname] = server.put(PODS, p)
    return out


def restart(
    server: FakeApiServer, p: dict[str, Any], count: int, code: int, why: str
) -> dict[str, Any]:
    """The kubelet restarted the pod's container in place (restartPolicy OnFailure)."""
    p = copy.deepcopy(server.get(f"{PODS}/{p['metadata']['name']}"))
    assert p is not None
    p["status"]["containerStatuses"] = [
        {
            "name": "pytorch",
            "restartCount": count,
            "state": {"running": {"startedAt": "2024-01-01T00:00:00Z"}},
            "lastState": {"terminated": {"exitCode": code, "reason": why}},
        }
    ]
    return server.put(PODS, p)


def statuses(rec: Recorder) -> list[tuple[str, str, list[int]]]:
    return [(s.phase, s.reason, s.exit_codes) for s in rec.of(WorkloadStatus)]


def phases(rec: Recorder) -> list[str]:
    return [s.phase for s in rec.of(WorkloadStatus)]


# -- pure: verdicts -------------------------------------------------------------------------


def conds(*items: tuple[str, str]) -> KJobStatus:
    return msgspec.convert(
        {"conditions": [{"type": t, "status": s, "reason": f"R{t}"} for t, s in items]},
        KJobStatus,
    )


@pytest.mark.parametrize(
    ("api_version", "kind", "status", "expected"),
    [
        # Kubeflow (PyTorchJob, TFJob, MPIJob, ...)
        ("kubeflow.org/v1", "PyTorchJob", conds(("Created", "True")), None),
        ("kubeflow.org/v1", "PyTorchJob", conds(("Running", "True")), None),
        ("kubeflow.org/v1", "PyTorchJob", conds(("Restarting", "True")), None),
        (
            "kubeflow.org/v1",
            "PyTorchJob",
            conds(("Running", "False"), ("Failed", "True")),
            "failed",
        ),
        ("kubeflow.org/v2beta1", "MPIJob", conds(("Succeeded", "True")), "succeeded"),
        ("kubeflow.org/v1", "TFJob", conds(("Failed", "False")), None),
        # batch/v1
        ("batch/v1", "Job", conds(("Complete", "True")), "succeeded"),
        ("batch/v1", "Job", conds(("SuccessCriteriaMet", "True")), "succeeded"),
        ("batch/v1", "Job", conds(("FailureTarget", "True")), "failed"),
        ("batch/v1", "Job", conds(("FailureTarget", "True"), ("Failed", "True")), "failed"),
        ("batch/v1", "Job", conds(("Suspended", "True")), None),
        # JobSet
        ("jobset.x-k8s.io/v1alpha2", "JobSet", conds(("Completed", "True")), "succeeded"),
        ("jobset.x-k8s.io/v1alpha2", "JobSet", conds(("Failed", "True")), "failed"),
        ("jobset.x-k8s.io/v1alpha2", "JobSet", conds(("Suspended", "True")), None),
        # a group Muster does not know: no verdict, whatever the conditions say
        ("example.com/v1", "Thing", conds(("Failed", "True")), None),
        ("kubeflow.org/v1", "PyTorchJob", KJobStatus(), None),
    ],
)
def test_job_verdict_from_conditions(
    api_version: str, kind: str, status: KJobStatus, expected: str | None
) -> None:
    verdict = job_verdict(api_version, kind, "x-a1", status)
    assert (verdict.phase if verdict else None) == expected


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        ("Pending", None),
        ("Running", None),
        ("Restarting", None),
        ("Completing", "succeeded"),
        ("Completed", "succeeded"),
        ("Aborting", "failed"),
        ("Aborted", "failed"),
        ("Terminating", "failed"),
        ("Terminated", "failed"),
        ("Failed", "failed"),
        ("", None),
    ],
)
def test_job_verdict_volcano_state(phase: str, expected: str | None) -> None:
    status = msgspec.convert({"state": {"phase": phase}}, KJobStatus)
    verdict = job_verdict("batch.volcano.sh/v1alpha1", "Job", "v-a1", status)
    assert (verdict.phase if verdict else None) == expected


def test_job_verdict_reason_names_object_type_reason_message_and_is_clipped() -> None:
    status = msgspec.convert({"conditions": [FAILED_BACKOFF]}, KJobStatus)
    verdict = job_verdict("kubeflow.org/v1", "PyTorchJob", "job-1-a1", status)
    assert verdict is not None
    assert verdict.reason == (
        "PyTorchJob job-1-a1: Failed (BackoffLimitExceeded): "
        "PyTorchJob job-1-a1 is failed because 1 Worker replica(s) failed."
    )
    volcano = msgspec.convert(
        {"state": {"phase": "Aborted", "reason": "PodEvicted", "message": "m"}}, KJobStatus
    )
    v = job_verdict("batch.volcano.sh/v1alpha1", "Job", "v-a1", volcano)
    assert v is not None and v.reason == "Volcano Job v-a1: Aborted (PodEvicted): m"
    huge = msgspec.convert({"conditions": [{**FAILED_BACKOFF, "message": "x" * 5000}]}, KJobStatus)
    v = job_verdict("kubeflow.org/v1", "PyTorchJob", "job-1-a1", huge)
    assert v is not None and len(v.reason) == 1024 and v.reason.endswith("...")
    # The last terminal condition listed wins (operators append the newest).
    both = conds(("Failed", "True"), ("Succeeded", "True"))
    v = job_verdict("kubeflow.org/v1", "PyTorchJob", "j", both)
    assert v is not None and v.phase == "succeeded"


def test_decode_job_status_is_tolerant() -> None:
    assert decode_job_status(msgspec.Raw(b"null")) == KJobStatus()
    assert decode_job_status(msgspec.Raw(b"{}")) == KJobStatus()
    ok = decode_job_status(
        msgspec.Raw(b'{"conditions":[{"type":"Failed","status":"True","x":1}],"new":[1]}')
    )
    assert ok is not None and ok.conditions is not None and ok.conditions[0].type == "Failed"
    for bad in [b'{"conditions":"nope"}', b'{"conditions":[{"type":5}]}', b'"x"', b"[1]"]:
        assert decode_job_status(msgspec.Raw(bad)) is None, bad
    # A KJob keeps its status raw, so a bad status does not fail the object's metadata.
    obj = msgspec.json.decode(
        b'{"metadata":{"name":"a"},"status":{"conditions":{"weird":true}}}', type=KJob
    )
    assert obj.metadata.name == "a" and decode_job_status(obj.status) is None
    assert msgspec.json.decode(b'{"metadata":{"name":"b"}}', type=KJob).status == msgspec.Raw(
        b"null"
    )


def test_decode_list_lenient_skips_bad_items_only() -> None:
    body = json.dumps(
        {
            "metadata": {"resourceVersion": "9"},
            "items": [
                {"metadata": {"name": "good"}},
                {"metadata": {"name": "bad", "labels": ["not", "a", "map"]}},
                {"metadata": {"name": "also-good"}, "status": {"conditions": 7}},
            ],
        }
    ).encode()
    page, skipped = decode_list_lenient(body, KJob)
    assert skipped == 1 and page.metadata.resourceVersion == "9"
    assert [o.metadata.name for o in page.items or []] == ["good", "also-good"]
    page, skipped = decode_list_lenient(b'{"items":[{"metadata":{"name":"x"}}]}', KJob)
    assert skipped == 0 and [o.metadata.name for o in page.items or []] == ["x"]
    with pytest.raises(msgspec.DecodeError):
        decode_list_lenient(b"not json", KJob)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
_status_like = st.fixed_dictionaries(
    {},
    optional={
        "conditions": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "type": st.sampled_from(["Failed", "Complete", "Succeeded", "Completed"])
                    | _json,
                    "status": st.sampled_from(["True", "False"]) | _json,
                    "reason": st.text(max_size=20) | _json,
                    "message": st.text(max_size=2000) | _json,
                },
            ),
            max_size=4,
        )
        | _json,
        "state": st.fixed_dictionaries({}, optional={"phase": st.text(max_size=12) | _json})
        | _json,
    },
)


@settings(max_examples=200, deadline=None)
@given(status=_status_like | _json)
def test_any_status_decodes_or_is_rejected_never_raises(status: Any) -> None:
    raw = msgspec.Raw(json.dumps(status).encode())
    decoded = decode_job_status(raw)
    if decoded is None:
        return
    for res in STATUS_RESOURCES:
        verdict = job_verdict(res.api_version, res.kind, "n", decoded)
        if verdict is not None:
            assert verdict.phase in ("succeeded", "failed")
            assert 0 < len(verdict.reason) <= 1024


# -- pure: restarts and the workload --------------------------------------------------------


def kpod(name: str, statuses: list[dict[str, Any]], phase: str = "Running") -> KPod:
    raw = pod(name, "n1", namespace=NS, phase=phase, container_statuses=statuses)
    return msgspec.convert(raw, KPod)


def cs(count: int, code: int | None = None, why: str = "", name: str = "pytorch") -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "restartCount": count, "state": {"running": {}}}
    if code is not None:
        out["lastState"] = {"terminated": {"exitCode": code, "reason": why}}
    return out


def test_restart_note_and_codes_from_container_statuses() -> None:
    v = classify(kpod("worker-1", [cs(3, 137, "OOMKilled")]))
    assert (v.kind, v.restarts, v.restart_codes) == ("running", 3, [137])
    assert v.restart_note == "worker-1 restarted 3 times (exit 137 OOMKilled)"
    v = classify(kpod("w", [cs(1, 1, "Error", "a"), cs(0, name="b"), cs(2, 0, "", "c")]))
    assert v.restarts == 3 and v.restart_codes == [1]  # exit 0 is no error code
    assert v.restart_note == "w/a restarted once (exit 1 Error), w/c restarted 2 times (exit 0)"
    v = classify(kpod("w", [cs(4)]))  # no lastState recorded
    assert (v.restarts, v.restart_codes, v.restart_note) == (4, [], "w restarted 4 times")
    assert classify(kpod("w", [cs(0)])).restarts == 0


def test_workload_keeps_restart_history_and_reports_it_on_the_next_transition() -> None:
    w = Workload("job-1", 1, total=2)
    w.update_pod("u1", kpod("w0", [cs(0)]))
    w.update_pod("u2", kpod("w1", [cs(0)], phase="Pending"))
    assert w.transition() is not None and w.last_phase == "created"
    w.update_pod("u2", kpod("w1", [cs(1, 1, "Error")], phase="Pending"))
    w.update_pod("u2", kpod("w1", [cs(2, 137, "OOMKilled")], phase="Pending"))
    assert w.transition() is None  # a restart is no phase of its own
    w.update_pod("u2", kpod("w1", [cs(2, 137, "OOMKilled")]))
    st_ = w.transition()
    assert st_ is not None and st_.phase == "running"
    assert st_.exit_codes == [1, 137]  # every code seen, in order
    assert st_.reason == "w1 restarted 2 times (exit 137 OOMKilled)"
    # The pod is deleted behind our back: the stub has no statuses, the history stays.
    stub = KPod()
    stub.metadata.name = "w1"
    w.update_pod("u2", stub, deleted=True)
    st_ = w.transition()
    assert st_ is not None and st_.phase == "evicted"
    assert st_.exit_codes == [1, 137]
    assert st_.reason == "pod w1: pod deleted; w1 restarted 2 times (exit 137 OOMKilled)"
    assert w.restarted_pods == 1


def test_workload_object_verdicts() -> None:
    from agents.kube.status import JobVerdict

    ok = JobVerdict("succeeded", "Job a: Complete")
    bad = JobVerdict("failed", "Job b: Failed (BackoffLimitExceeded)")
    # Two objects with a status (an Indexed Job per podset): both must succeed.
    w = Workload("j", 1, total=4)
    w.expect_object(("jobs", "a"))
    w.expect_object(("jobs", "b"))
    w.update_object(("jobs", "a"), ok)
    assert w.current_phase() == "created"
    w.update_object(("jobs", "b"), ok)
    assert w.current_phase() == "succeeded"
    w.update_object(("jobs", "b"), bad)  # counters follow a changed verdict
    assert (w.jobs_succeeded, w.jobs_failed) == (1, 1)
    st_ = w.transition()
    assert st_ is not None and (st_.phase, st_.reason, st_.exit_codes) == (
        "failed",
        "Job b: Failed (BackoffLimitExceeded)",
        [],
    )
    assert w.transition() is None  # terminal: nothing more
    # A pod eviction outranks the object's failure (the preemption budget, not the error one).
    w = Workload("j", 2, total=1)
    w.expect_object(("pytorchjobs", "x"))
    w.update_object(("pytorchjobs", "x"), bad)
    stub = KPod()
    stub.metadata.name = "p"
    w.update_pod("u", kpod("p", []))
    w.update_pod("u", stub, deleted=True)
    assert w.current_phase() == "evicted"
    # No object known: pods alone decide, as before.
    w = Workload("j", 3, total=1)
    w.update_pod("u", kpod("p", [], phase="Succeeded"))
    assert w.current_phase() == "succeeded"


# -- on the wire ----------------------------------------------------------------------------


async def test_pytorchjob_failed_while_pods_run_in_place_restarts_reported(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """restartPolicy OnFailure: the worker's container restarts inside a Running pod, the
    Training Operator gives up (BackoffLimitExceeded) while every pod still runs."""
    backend, rec = await make_backend()
    await backend.dispatch(manifest_dispatch(PYTORCHJOB_YAML, job_id="job-1", attempt=1))
    pods = kubeflow_pods(apiserver)
    await rec.wait_for(lambda: phases(rec) == ["created", "running"])
    set_status(
        apiserver,
        PYTORCHJOBS,
        "job-1-a1",
        {
            "conditions": [
                {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                {"type": "Running", "status": "True", "reason": "PyTorchJobRunning"},
            ]
        },
    )
    restart(apiserver, pods["job-1-a1-worker-1"], 2, 137, "OOMKilled")
    # No phase of its own: the running attempt says `running` again, with the restarts.
    await rec.wait_for(lambda: phases(rec) == ["created", "running", "running"])
    assert statuses(rec)[2] == (
        "running",
        "job-1-a1-worker-1 restarted 2 times (exit 137 OOMKilled)",
        [137],
    )
    restart(apiserver, pods["job-1-a1-worker-1"], 2, 137, "OOMKilled")  # nothing new
    await caught_up(apiserver, backend)
    assert len(phases(rec)) == 3
    set_status(
        apiserver,
        PYTORCHJOBS,
        "job-1-a1",
        {
            "conditions": [
                {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                {"type": "Running", "status": "False", "reason": "PyTorchJobRunning"},
                FAILED_BACKOFF,
            ]
        },
    )
    await rec.wait_for(lambda: len(phases(rec)) == 4)
    assert statuses(rec)[3] == (
        "failed",
        "PyTorchJob job-1-a1: Failed (BackoffLimitExceeded): PyTorchJob job-1-a1 is failed "
        "because 1 Worker replica(s) failed.; "
        "job-1-a1-worker-1 restarted 2 times (exit 137 OOMKilled)",
        [137],
    )
    last = rec.of(WorkloadStatus)[-1]
    assert (last.job_id, last.attempt, last.running_replicas, last.total_replicas) == (
        "job-1",
        1,
        3,
        3,
    )
    # The operator then deletes the pods; the attempt already ended: nothing more.
    for name in pods:
        apiserver.remove(f"{PODS}/{name}")
    await caught_up(apiserver, backend)
    assert phases(rec) == ["created", "running", "running", "failed"]
    snap = await backend.snapshot()
    assert [(w.phase, w.exit_codes) for w in snap.workloads] == [("failed", [137])]


async def test_restart_before_the_gang_runs_rides_on_running(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, rec = await make_backend()
    await backend.dispatch(manifest_dispatch(PYTORCHJOB_YAML, job_id="job-1", attempt=1))
    pods = kubeflow_pods(apiserver, phase="Pending")
    master = pods["job-1-a1-master-0"]
    apiserver.put(PODS, {**master, "status": {**master["status"], "phase": "Running"}})
    restart(apiserver, master, 1, 1, "Error")
    await caught_up(apiserver, backend)
    assert phases(rec) == ["created"]
    for name in ("job-1-a1-worker-0", "job-1-a1-worker-1"):
        p = copy.deepcopy(apiserver.get(f"{PODS}/{name}"))
        assert p is not None
        p["status"]["phase"] = "Running"
        apiserver.put(PODS, p)
    await rec.wait_for(lambda: phases(rec) == ["created", "running"])
    assert statuses(rec)[1] == ("running", "job-1-a1-master-0 restarted once (exit 1 Error)", [1])


async def test_batch_job_complete_after_pods_gone_is_succeeded(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """The pods went away without the pod watch seeing them finish (removed while it was
    away); the Job's own Complete condition still ends the attempt as succeeded."""
    apiserver.put(NODES, node("n1"))
    apiserver.put(NODES, node("n2"))
    backend, rec = await make_backend()
    made = await running_indexed_job(apiserver, backend, rec)
    for p in made:
        apiserver.remove(f"{PODS}/{p['metadata']['name']}", silent=True)
    set_status(
        apiserver,
        BATCH_JOBS,
        "job-1-a1-worker",
        {
            "succeeded": 2,
            "conditions": [
                {"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached"},
                {"type": "Complete", "status": "True", "reason": "CompletionsReached"},
            ],
        },
    )
    await rec.wait_for(lambda: len(phases(rec)) == 3)
    assert statuses(rec)[2] == ("succeeded", "", [])
    # A later re-list finds the pods gone: the attempt has ended, nothing more is said.
    pr = backend.pod_reflector
    assert pr is not None
    apiserver.expire_watches()
    await rec.wait_for(lambda: pr.gone >= 1 and pr.lists >= 2)
    await caught_up(apiserver, backend)
    assert phases(rec) == ["created", "running", "succeeded"]


async def test_batch_job_success_policy_then_lingering_pod_deleted(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """Job successPolicy: index 0 succeeded -> SuccessCriteriaMet, and the Job controller
    deletes the other pod. Without the Job's verdict that deletion would read as an eviction."""
    backend, rec = await make_backend()
    made = await running_indexed_job(apiserver, backend, rec)
    apiserver.put(PODS, {**made[0], "status": {**made[0]["status"], "phase": "Succeeded"}})
    set_status(
        apiserver,
        BATCH_JOBS,
        "job-1-a1-worker",
        {
            "conditions": [
                {"type": "SuccessCriteriaMet", "status": "True", "reason": "SuccessPolicy"},
            ]
        },
    )
    await rec.wait_for(lambda: len(phases(rec)) == 3)
    apiserver.remove(f"{PODS}/{made[1]['metadata']['name']}")
    await caught_up(apiserver, backend)
    assert phases(rec) == ["created", "running", "succeeded"]


@pytest.mark.parametrize(
    ("text", "resource", "status", "expected"),
    [
        (
            VOLCANO_YAML,
            VOLCANO_JOB,
            {"state": {"phase": "Aborted", "reason": "PodEvicted", "message": "policy"}},
            ("failed", "Volcano Job m-1-a1: Aborted (PodEvicted): policy"),
        ),
        (
            VOLCANO_YAML,
            VOLCANO_JOB,
            {"state": {"phase": "Failed"}},
            ("failed", "Volcano Job m-1-a1: Failed"),
        ),
        (
            VOLCANO_YAML,
            VOLCANO_JOB,
            {"state": {"phase": "Completed"}},
            ("succeeded", ""),
        ),
        (
            JOBSET_YAML,
            JOBSET,
            {
                "conditions": [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "FailedJobs",
                        "message": "jobset failed due to one or more job failures",
                    },
                ]
            },
            (
                "failed",
                "JobSet m-1-a1: Failed (FailedJobs): jobset failed due to one or more job failures",
            ),
        ),
        (
            JOBSET_YAML,
            JOBSET,
            {"conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted"}]},
            ("succeeded", ""),
        ),
        (
            MPIJOB_YAML,
            MPIJOB,
            {"conditions": [{"type": "Failed", "status": "True", "reason": "MPIJobFailed"}]},
            ("failed", "MPIJob m-1-a1: Failed (MPIJobFailed)"),
        ),
        (
            TFJOB_YAML,
            TFJOB,
            {"conditions": [{"type": "Succeeded", "status": "True"}]},
            ("succeeded", ""),
        ),
    ],
)
async def test_object_verdict_per_kind(
    apiserver: FakeApiServer,
    make_backend: Any,
    text: str,
    resource: Any,
    status: dict[str, Any],
    expected: tuple[str, str],
) -> None:
    backend, rec = await make_backend()
    await backend.dispatch(manifest_dispatch(text, job_id="m-1", attempt=1))
    collection = resource.collection(NS)
    assert apiserver.get(f"{collection}/m-1-a1") is not None
    # Undecided states first: nothing is emitted for them.
    set_status(
        apiserver,
        collection,
        "m-1-a1",
        {"state": {"phase": "Running"}, "conditions": [{"type": "Running", "status": "True"}]},
    )
    await caught_up(apiserver, backend)
    assert phases(rec) == ["created"]
    set_status(apiserver, collection, "m-1-a1", status)
    await rec.wait_for(lambda: len(phases(rec)) == 2)
    assert statuses(rec)[1] == (*expected, [])


async def test_objects_not_musters_are_ignored(apiserver: FakeApiServer, make_backend: Any) -> None:
    backend, rec = await make_backend()
    await backend.dispatch(manifest_dispatch(PYTORCHJOB_YAML, job_id="job-1", attempt=1))
    mine = apiserver.get(f"{PYTORCHJOBS}/job-1-a1")
    assert mine is not None
    failed = {"conditions": [{**FAILED_BACKOFF, "message": "IMPOSTOR"}]}
    # Same labels and annotations, another namespace.
    other = copy.deepcopy(mine)
    other["metadata"].pop("namespace")
    other["status"] = failed
    apiserver.put(PYTORCHJOB.collection("team-b"), other)
    # The workload namespace, claiming the job by annotation only, or without the top label.
    for name, drop in (
        ("no-label", LABEL_JOB),
        ("no-top", LABEL_TOP),
        ("no-attempt", LABEL_ATTEMPT),
    ):
        o = copy.deepcopy(mine)
        o["metadata"]["name"] = name
        o["metadata"]["labels"].pop(drop)
        o["status"] = failed
        apiserver.put(PYTORCHJOBS, o)
    # Lines a server (or a proxy) should never send on this watch: ignored all the same.
    await Recorder().wait_for(lambda: apiserver.watch_count("pytorchjobs") == 1)
    await caught_up(apiserver, backend)
    jr = backend.job_reflectors[PYTORCHJOBS]
    delivered = jr.events
    for ns, labels in (
        ("team-b", mine["metadata"]["labels"]),
        (NS, {}),
        (NS, {k: v for k, v in mine["metadata"]["labels"].items() if k != LABEL_TOP}),
    ):
        raw = {
            "metadata": {
                "name": "raw",
                "namespace": ns,
                "labels": labels,
                "annotations": {ANN_JOB: "job-1"},
                "resourceVersion": str(apiserver.rv),
            },
            "status": failed,
        }
        apiserver.send_raw(json.dumps({"type": "MODIFIED", "object": raw}).encode() + b"\n")
    await wait_for(lambda: jr.events == delivered + 3, what="the three lines handled")
    assert phases(rec) == ["created"]
    # The watch is namespaced and selects Muster's top-level objects on the server side too.
    watches = [
        (p, q)
        for m, p, q in apiserver.requests
        if p.endswith("/pytorchjobs") and q.get("watch") == "true"
    ]
    assert watches and all(
        p == PYTORCHJOBS and q.get("labelSelector") == selector() for p, q in watches
    )
    # The real object's verdict still gets through (the test is not vacuous).
    set_status(apiserver, PYTORCHJOBS, "job-1-a1", {"conditions": [FAILED_BACKOFF]})
    await rec.wait_for(lambda: len(phases(rec)) == 2)
    assert rec.of(WorkloadStatus)[1].phase == "failed"
    assert "IMPOSTOR" not in rec.of(WorkloadStatus)[1].reason
    assert "is failed because 1 Worker" in rec.of(WorkloadStatus)[1].reason


async def test_absent_crds_do_not_stop_nodes_and_pods_and_are_picked_up_later(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.missing_groups = {"kubeflow.org", "jobset.x-k8s.io", "batch.volcano.sh"}
    apiserver.put(NODES, node("n1"))
    loop = asyncio.get_running_loop()
    started = loop.time()  # before the first list
    backend, rec = await make_backend(resync_period_s=2.0)
    assert {n.name for n in (await backend.snapshot()).nodes} == {"n1"}
    absent = {jr.name: jr.absent for jr in backend.job_reflectors.values()}
    assert absent["pytorchjobs.kubeflow.org"] == 404
    assert absent["jobsets.jobset.x-k8s.io"] == 404 and absent["jobs.batch"] == 0
    # Node and pod reporting go on.
    apiserver.put("/api/v1/namespaces/team/pods", pod("a", "n1", "team", gpu=3))
    await rec.wait_for(lambda: any(e.node.other_gpu == 3 for e in rec.of(NodeUpsert)))
    # No hot retry loop on the missing kinds (the test config backs off from 0.05 s, a hot
    # loop would list again within 0.3 s). A rate needs a window; the bound grows with the
    # time that really passed, so a slow machine cannot turn a correct retry into a failure.
    await asyncio.sleep(0.3)
    lists = [p for m, p, q in apiserver.requests if p == PYTORCHJOBS and m == "GET"]
    assert len(lists) <= 1 + (loop.time() - started) // 2.0, lists
    # The CRD gets installed: picked up at the next retry (one resync period).
    apiserver.missing_groups = set()
    jr = backend.job_reflectors[PYTORCHJOBS]
    await rec.wait_for(lambda: jr.absent == 0 and apiserver.watch_count("pytorchjobs"), 5)
    await backend.dispatch(manifest_dispatch(PYTORCHJOB_YAML, job_id="job-1", attempt=1))
    set_status(apiserver, PYTORCHJOBS, "job-1-a1", {"conditions": [FAILED_BACKOFF]})
    await rec.wait_for(lambda: phases(rec) == ["created", "failed"])


async def test_malformed_objects_are_counted_and_ignored(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any
) -> None:
    # Already there at start: an item that does not decode at all, one with a bad status, and
    # a good one that has failed. The start must not fail, and the good one must count.
    good = {
        "metadata": {
            "name": "old-a1",
            "labels": {LABEL_JOB: "old", LABEL_ATTEMPT: "1", LABEL_TOP: "true"},
            "annotations": {ANN_JOB: "old"},
        },
        "status": {"conditions": [FAILED_BACKOFF]},
    }
    broken = copy.deepcopy(good)
    broken["metadata"].update(name="broken-a1", annotations={ANN_JOB: 7})  # not a string
    bad_status = copy.deepcopy(good)
    bad_status["metadata"]["name"] = "bad-a1"
    bad_status["metadata"]["labels"][LABEL_JOB] = "bad"
    bad_status["metadata"]["annotations"] = {ANN_JOB: "bad"}
    bad_status["status"] = {"conditions": [{"type": ["Failed"], "status": True}]}
    for obj in (good, broken, bad_status):
        apiserver.put(PYTORCHJOBS, obj)
    backend, rec = await make_backend()
    snap = await backend.snapshot()
    assert sorted((w.job_id, w.phase) for w in snap.workloads) == [
        ("bad", "created"),
        ("old", "failed"),
    ]
    assert backend.bad_objects == 1
    # Live: a malformed status and a garbage line are skipped; the watch carries on.
    await Recorder().wait_for(lambda: apiserver.watch_count("pytorchjobs") == 1)
    await backend.dispatch(manifest_dispatch(PYTORCHJOB_YAML, job_id="job-1", attempt=1))
    set_status(apiserver, PYTORCHJOBS, "job-1-a1", {"conditions": "Failed"})
    apiserver.send_raw(b'{"type":"MODIFIED","object":{"metadata":{"name":5}}}\n', "pytorchjobs")
    apiserver.send_raw(b"}{ not json\n", "pytorchjobs")
    jr = backend.job_reflectors[PYTORCHJOBS]
    # The status update came before the two lines on the same watch: handled too.
    await wait_for(lambda: jr.bad_lines == 2, what="the two bad lines handled")
    assert phases(rec) == ["created"]
    assert backend.bad_objects == 2
    assert jr.bad_lines == 2 and jr.errors == 0
    set_status(apiserver, PYTORCHJOBS, "job-1-a1", {"conditions": [FAILED_BACKOFF]})
    await rec.wait_for(lambda: phases(rec) == ["created", "failed"])


async def test_cancelled_attempt_reports_no_verdict(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, rec = await make_backend()
    await backend.dispatch(manifest_dispatch(PYTORCHJOB_YAML, job_id="job-1", attempt=1))
    obj = copy.deepcopy(apiserver.get(f"{PYTORCHJOBS}/job-1-a1"))
    assert obj is not None
    await backend.cancel("job-1", 1, "user")
    # A late status update (or the object re-created by a stale client) says nothing.
    obj["status"] = {"conditions": [FAILED_BACKOFF]}
    apiserver.put(PYTORCHJOBS, obj)
    await caught_up(apiserver, backend)
    assert phases(rec) == ["created"]


def test_status_resources_are_what_manifests_can_create_with_a_status() -> None:
    assert {r.kind for r in STATUS_RESOURCES} == {
        "Job",
        "PyTorchJob",
        "TFJob",
        "MPIJob",
        "XGBoostJob",
        "PaddleJob",
        "JAXJob",
        "JobSet",
        "RayJob",
        "TrainJob",
    }
    assert BATCH_JOB in STATUS_RESOURCES and VOLCANO_JOB in STATUS_RESOURCES
