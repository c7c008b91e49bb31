"""Node signals through the real backend and the stand-in API server, with a clock the test
moves: takes no new pods / going away / gone, debounced GPU dips, NotReady grace, capacity."""

from __future__ import annotations

import copy
from typing import Any

from schemas.agent import GpuHealth, NodeGone, NodeUpsert, SpotNotice, WorkloadStatus
from tests.kube.conftest import (
    NODES,
    NOW,
    NS,
    Clock,
    Recorder,
    caught_up,
    gang_dispatch,
    node,
    pod,
    rfc3339,
    run_job_pod,
)
from tests.kube.fake_apiserver import FakeApiServer


def last(rec: Recorder, name: str) -> Any:
    ups = [e.node for e in rec.of(NodeUpsert) if e.node.name == name]
    return ups[-1] if ups else None


def with_gpus(raw: dict[str, Any], allocatable: int, capacity: int | None = None) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    out["status"]["allocatable"]["nvidia.com/gpu"] = str(allocatable)
    if capacity is not None:
        out["status"]["capacity"]["nvidia.com/gpu"] = str(capacity)
    return out


async def test_device_plugin_restart_8_0_8_ends_nothing(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """A GPU Operator upgrade restarts the device plugin: allocatable 8 -> 0 -> 8 within 30 s.
    Nothing is reported; a dip that outlasts the window only stops new pods."""
    raw = node("g1")
    apiserver.put(NODES, raw)
    clock = Clock()
    backend, rec = await make_backend(clock=clock, allocatable_debounce_s=60)
    apiserver.put(NODES, with_gpus(raw, 0))
    await rec.wait_for(lambda: backend.node_signals()["g1"].dip_since == NOW)
    clock.advance(29)
    backend.evaluate_timers()
    apiserver.put(NODES, raw)
    await rec.wait_for(lambda: backend.node_signals()["g1"].dip_since is None)
    assert rec.events == []  # no NodeUpsert, no GpuHealth: the broker never saw the dip

    # The plugin goes away for longer, and the kubelet drops the resource from capacity too:
    # past the window the node takes no new pods; it is never "failed" nor "not ready".
    apiserver.put(NODES, with_gpus(raw, 0, capacity=0))
    await rec.wait_for(lambda: backend.node_signals()["g1"].dip_since is not None)
    clock.advance(61)
    backend.evaluate_timers()
    await rec.wait_for(lambda: last(rec, "g1") is not None)
    info = last(rec, "g1")
    assert info.no_new_pods and info.ready and info.gpu == 8 and info.gpu_healthy is None
    assert "8 of 8 nvidia.com/gpu not allocatable" in info.note
    assert not rec.of(GpuHealth) and not rec.of(NodeGone)
    apiserver.put(NODES, raw)
    await rec.wait_for(lambda: not last(rec, "g1").no_new_pods)


async def test_not_ready_takes_no_new_pods_and_is_lost_only_when_out_of_service(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    raw = node("n1")
    apiserver.put(NODES, raw)
    clock = Clock()
    backend, rec = await make_backend(clock=clock, not_ready_grace_s=120)
    down = node("n1", ready=False)
    down["status"]["conditions"][0]["lastTransitionTime"] = rfc3339(NOW)
    apiserver.put(NODES, down)
    await rec.wait_for(lambda: last(rec, "n1") is not None)
    info = last(rec, "n1")
    assert info.ready and info.no_new_pods and "NotReady" in info.note
    clock.advance(10)
    backend.evaluate_timers()
    assert last(rec, "n1").ready  # 10 s NotReady: nothing lost
    apiserver.put(NODES, raw)  # back
    await rec.wait_for(lambda: not last(rec, "n1").no_new_pods)
    # Down again, and this time for longer than the grace: still no proof that its containers
    # stopped (a partitioned node keeps running them), so nothing is lost ...
    down["status"]["conditions"][0]["lastTransitionTime"] = rfc3339(clock.now - 100)
    apiserver.put(NODES, down)
    await rec.wait_for(lambda: last(rec, "n1").no_new_pods)
    clock.advance(21)
    backend.evaluate_timers()
    assert last(rec, "n1").ready and "out-of-service" in last(rec, "n1").note
    # ... until an operator declares it shut down. The grace runs from the condition's own
    # transition time, not from when the agent saw it.
    down["spec"]["taints"] = [
        {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}
    ]
    apiserver.put(NODES, down)
    await rec.wait_for(lambda: not last(rec, "n1").ready)


async def test_cordon_takes_no_new_pods_and_deletion_is_a_notice(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    raw = node("n1", provider_id="aws:///us-east-1a/i-1")
    apiserver.put(NODES, raw)
    clock = Clock()
    backend, rec = await make_backend(clock=clock)
    cordoned = copy.deepcopy(raw)
    cordoned["spec"]["unschedulable"] = True
    apiserver.put(NODES, cordoned)
    # A plain `kubectl cordon` keeps what runs there: no deadline, only no new pods.
    await rec.wait_for(lambda: last(rec, "n1") is not None and last(rec, "n1").no_new_pods)
    await caught_up(apiserver, backend)
    assert rec.of(SpotNotice) == []
    info = last(rec, "n1")
    assert info.ready and info.note == "cordoned" and info.spot_deadline is None
    # Karpenter deletes the node (its finalizer keeps it while it drains): the deadline is
    # already armed; the deletion adds a reason, never a loss.
    clock.advance(5)
    deleting = copy.deepcopy(cordoned)
    deleting["metadata"]["finalizers"] = ["karpenter.sh/termination"]
    deleting["metadata"]["deletionTimestamp"] = rfc3339(clock.now)
    apiserver.put(NODES, deleting)
    await rec.wait_for(lambda: "being deleted" in last(rec, "n1").note)
    (notice,) = rec.of(SpotNotice)
    assert notice.deadline == clock.now + 120 and "node being deleted" in notice.reason
    assert last(rec, "n1").ready
    # Only the Node object's removal is proof: its finalizer is removed, it is gone.
    gone = copy.deepcopy(apiserver.get(f"{NODES}/n1"))
    assert gone is not None
    gone["metadata"]["finalizers"] = []
    apiserver.put(NODES, gone)
    await rec.wait_for(lambda: rec.of(NodeGone))


async def test_deadline_comes_from_the_signal_not_from_when_it_was_seen(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    raw = node("n1", provider_id="gce://p/z/n1", labels={"cloud.google.com/gke-spot": "true"})
    raw["spec"]["taints"] = [
        {
            "key": "ToBeDeletedByClusterAutoscaler",
            "value": str(int(NOW) - 20),
            "effect": "NoSchedule",
        }
    ]
    apiserver.put(NODES, raw)
    backend, rec = await make_backend()
    snap = await backend.snapshot()
    assert snap.nodes[0].spot_deadline == NOW - 20 + 30  # GCP window, from the taint's time
    assert [n.deadline for n in rec.of(SpotNotice)] == [NOW + 10]


async def test_untolerated_taint_and_wrong_gpu_product_are_not_capacity(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("t1", taints=[{"key": "team", "value": "a", "effect": "NoSchedule"}]))
    apiserver.put(NODES, node("h1", labels={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}))
    apiserver.put(NODES, node("ok"))
    backend, _ = await make_backend()
    by_name = {n.name: n for n in (await backend.snapshot()).nodes}
    assert by_name["t1"].no_new_pods and "team=a:NoSchedule" in by_name["t1"].note
    assert by_name["h1"].no_new_pods and "H100" in by_name["h1"].note
    assert not by_name["ok"].no_new_pods
    assert backend.bad_input.counts[("Node", "GPU product disagrees with its flavor")] == 1


async def test_node_leaving_the_selector_takes_no_new_pods_deleted_is_gone(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1", labels={"gpu": "yes", "karpenter.sh/capacity-type": "spot"}))
    apiserver.put(NODES, node("n2", labels={"gpu": "yes", "karpenter.sh/capacity-type": "spot"}))
    _, rec = await make_backend(node_label_selector="gpu=yes")
    moved = node("n1", labels={"gpu": "no", "karpenter.sh/capacity-type": "spot"})
    apiserver.put(NODES, moved)  # the watch says DELETED: it stopped matching
    await rec.wait_for(lambda: last(rec, "n1") is not None)
    assert last(rec, "n1").no_new_pods and "left the node selector" in last(rec, "n1").note
    assert not rec.of(NodeGone)
    apiserver.remove(f"{NODES}/n2")
    await rec.wait_for(lambda: [e.node for e in rec.of(NodeGone)] == ["n2"])


async def test_terminating_pods_of_an_ended_attempt_hold_their_gpus(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    apiserver.termination_s = None  # the kubelet confirms when the test says so
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch(replicas=1))
    run_job_pod(apiserver, "job-1-a1-worker", "n1")
    await rec.wait_for(lambda: any(s.phase == "running" for s in rec.of(WorkloadStatus)))
    assert last(rec, "n1") is None or last(rec, "n1").other_gpu == 0  # the broker's own
    await backend.cancel("job-1", 1, "preempted")
    # The Job is gone at once, its pod stays Terminating with its GPUs.
    assert apiserver.get(f"/apis/batch/v1/namespaces/{NS}/jobs/job-1-a1-worker") is None
    assert len(apiserver.terminating()) == 1
    await rec.wait_for(lambda: last(rec, "n1") is not None and last(rec, "n1").other_gpu == 4)
    apiserver.finish_terminating()
    await rec.wait_for(lambda: last(rec, "n1").other_gpu == 0)


async def test_gpu_resources_per_flavor_and_mig_slices_count_apart(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    """A MIG profile is a flavor of its own with its own resource; a foreign pod holding a
    slice is no whole GPU on another flavor's node, and a MIG node is no failed GPU."""
    mig = node("m1", labels={"nvidia.com/mig.config": "all-1g.10gb"}, gpu=0)
    for part in ("capacity", "allocatable"):
        mig["status"][part]["nvidia.com/mig-1g.10gb"] = "56"
    mig["metadata"]["labels"]["nvidia.com/mig.strategy"] = "mixed"
    mig["metadata"]["labels"]["nvidia.com/gpu.count"] = "8"
    apiserver.put(NODES, mig)
    apiserver.put(NODES, node("g1"))
    slice_pod = pod("slice", "g1", "team")
    slice_pod["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "2"}
    apiserver.put("/api/v1/namespaces/team/pods", slice_pod)
    whole = pod("whole", "m1", "team", gpu=0)
    whole["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "3"}
    apiserver.put("/api/v1/namespaces/team/pods", whole)
    flavors = [
        {
            "name": "a100-mig-1g",
            "capacity_type": "spot",
            "gpu_type": "a100",
            "gpu_resource": "nvidia.com/mig-1g.10gb",
            "node_labels": {"nvidia.com/mig.config": "all-1g.10gb"},
        },
        {"name": "a100-spot", "capacity_type": "spot", "gpu_type": "a100"},
    ]
    backend, rec = await make_backend(flavors=flavors)
    by_name = {n.name: n for n in (await backend.snapshot()).nodes}
    m1, g1 = by_name["m1"], by_name["g1"]
    assert (m1.flavor, m1.gpu, m1.gpu_healthy, m1.other_gpu) == ("a100-mig-1g", 56, None, 3)
    assert not m1.no_new_pods
    assert (g1.flavor, g1.gpu, g1.other_gpu) == ("a100-spot", 8, 0)
    assert not rec.of(GpuHealth)
