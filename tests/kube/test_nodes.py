"""Pure node rules: capacity type per provider key, provider, flavor match, GFD, GPU health."""

from __future__ import annotations

import msgspec
import pytest

from agents.kube.decode import KNode, KPod, Usage, pod_usage
from agents.kube.nodes import (
    detect_capacity_type,
    detect_provider,
    gfd_memory_mib,
    gpu_state,
    is_ready,
    match_flavor,
    node_info,
    spot_signal,
)
from tests.kube.conftest import make_config, node, pod


def knode(obj: dict[str, object]) -> KNode:
    return msgspec.convert(obj, KNode)


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"karpenter.sh/capacity-type": "spot"}, "spot"),
        ({"karpenter.sh/capacity-type": "on-demand"}, "on-demand"),
        ({"karpenter.sh/capacity-type": "reserved"}, "on-demand"),
        ({"cloud.google.com/gke-spot": "true"}, "spot"),
        ({"cloud.google.com/gke-spot": "false"}, "on-demand"),
        ({"cloud.google.com/gke-preemptible": "true"}, "spot"),
        ({"cloud.google.com/gke-provisioning": "spot"}, "spot"),
        ({"cloud.google.com/gke-provisioning": "standard"}, "on-demand"),
        ({"kubernetes.azure.com/scalesetpriority": "spot"}, "spot"),
        ({"kubernetes.azure.com/scalesetpriority": "regular"}, "on-demand"),
        ({"eks.amazonaws.com/capacityType": "SPOT"}, "spot"),
        ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, "on-demand"),
        ({"pool": "a100"}, None),
    ],
)
def test_capacity_type_per_provider_key(labels: dict[str, str], expected: str | None) -> None:
    assert detect_capacity_type(labels) == expected


@pytest.mark.parametrize(
    ("provider_id", "labels", "expected"),
    [
        ("aws:///us-east-1a/i-0abc", {}, "aws"),
        ("gce://proj/us-central1-a/gke-node", {}, "gcp"),
        ("azure:///subscriptions/x/virtualMachineScaleSets/y/virtualMachines/0", {}, "azure"),
        ("", {"eks.amazonaws.com/capacityType": "SPOT"}, "aws"),
        ("", {"cloud.google.com/gke-spot": "true"}, "gcp"),
        ("", {"kubernetes.azure.com/scalesetpriority": "spot"}, "azure"),
        ("kind://docker/x", {"pool": "a100"}, "other"),
    ],
)
def test_provider(provider_id: str, labels: dict[str, str], expected: str) -> None:
    assert detect_provider(knode(node("n", labels=labels, provider_id=provider_id))) == expected


def test_flavor_match_uses_labels_and_detected_capacity_type() -> None:
    cfg = make_config()
    spot = knode(node("s", labels={"cloud.google.com/gke-spot": "true"}))
    od = knode(node("o", labels={"eks.amazonaws.com/capacityType": "ON_DEMAND"}))
    other_pool = knode(node("x", labels={"pool": "h100"}))
    undetected = knode(node("u", labels={}))
    assert match_flavor(spot, cfg.flavors).name == "a100-spot"  # type: ignore[union-attr]
    assert match_flavor(od, cfg.flavors).name == "a100-od"  # type: ignore[union-attr]
    assert match_flavor(other_pool, cfg.flavors) is None
    # No capacity key: the first flavor whose labels match (config order).
    assert match_flavor(undetected, cfg.flavors).name == "a100-spot"  # type: ignore[union-attr]


def test_gfd_labels() -> None:
    cfg = make_config()
    raw = node(
        "g",
        labels={
            "karpenter.sh/capacity-type": "spot",
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
            "nvidia.com/gpu.memory": "81920",
            "nvidia.com/gpu.count": "8",
        },
    )
    n = knode(raw)
    assert gfd_memory_mib(n) == 81920
    assert gpu_state(n, cfg).healthy is None
    # GFD says 8 GPUs, the device plugin registered only 7: one fell off the bus.
    raw["status"]["capacity"]["nvidia.com/gpu"] = "7"
    raw["status"]["allocatable"]["nvidia.com/gpu"] = "7"
    st = gpu_state(knode(raw), cfg)
    assert (st.total, st.healthy) == (8, 7)


def test_gpu_failure_detection() -> None:
    cfg = make_config()
    ok = gpu_state(knode(node("n")), cfg)
    assert ok.total == 8 and ok.healthy is None
    withdrawn = gpu_state(knode(node("n", allocatable_gpu=6)), cfg)
    assert (withdrawn.total, withdrawn.healthy) == (8, 6)
    cond = node(
        "n",
        conditions=[
            {"type": "SysLogsXIDError", "status": "True", "reason": "XID79", "message": "x"}
        ],
    )
    st = gpu_state(knode(cond), cfg)
    assert (st.healthy, st.xid) == (0, 79)
    false_cond = node("n", conditions=[{"type": "SysLogsXIDError", "status": "False"}])
    assert gpu_state(knode(false_cond), cfg).healthy is None
    tainted = node("n", taints=[{"key": "nvidia.com/gpu-xid-error", "value": "48"}])
    st = gpu_state(knode(tainted), cfg)
    assert (st.healthy, st.xid) == (0, 48)
    custom = make_config(gpu_failure_conditions=["GpuBroken"], gpu_failure_taints=[])
    assert gpu_state(knode(cond), custom).healthy is None
    broken = node("n", conditions=[{"type": "GpuBroken", "status": "True", "message": "Xid 13"}])
    assert gpu_state(knode(broken), custom).xid == 13


@pytest.mark.parametrize(
    "key",
    [
        "aws-node-termination-handler/spot-itn",
        "karpenter.sh/disrupted",
        "cloud.google.com/impending-node-termination",
        "node.kubernetes.io/out-of-service",
    ],
)
def test_spot_taints(key: str) -> None:
    cfg = make_config()
    n = knode(node("n", taints=[{"key": key, "effect": "NoSchedule"}]))
    assert spot_signal(n, cfg.spot_taints) == f"taint {key}"
    # The permanent Azure spot taint is a placement property, not a notice.
    azure = knode(
        node("n", taints=[{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot"}])
    )
    assert spot_signal(azure, cfg.spot_taints) is None


def test_ready_and_node_info() -> None:
    cfg = make_config()
    raw = node("n")
    n = knode(raw)
    assert is_ready(n)
    info = node_info(n, cfg.flavors[0], cfg, Usage(1, 2000, 3 * 2**30), 123.0)
    assert info.gpu == 8 and info.cpu_milli == 95_500 and info.memory == 1000 * 2**30
    assert (info.other_gpu, info.other_cpu_milli, info.other_memory) == (1, 2000, 3 * 2**30)
    assert info.spot_deadline == 123.0 and info.ready
    raw["spec"]["unschedulable"] = True
    assert not is_ready(knode(raw))
    assert not is_ready(knode(node("n", ready=False)))


def test_pod_usage_counts_limits_init_and_overhead() -> None:
    raw = pod("p", "n", gpu=2, cpu="500m", memory="2Gi")
    raw["spec"]["initContainers"] = [
        {"name": "init", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}},
        {
            "name": "sidecar",
            "restartPolicy": "Always",
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
        },
    ]
    raw["spec"]["overhead"] = {"cpu": "250m"}
    u = pod_usage(msgspec.convert(raw, KPod))
    assert u.gpu == 2  # GPU request defaults to its limit
    assert u.cpu_milli == 4000 + 250  # the init container's 4 CPUs dominate, plus overhead
    assert u.memory == 2 * 2**30 + 64 * 2**20
