"""Pure node rules: capacity type per provider key, provider, flavor match, GFD, GPU health,
notices per provider signal, untolerated taints, GPU product, readiness."""

from __future__ import annotations

import msgspec
import pytest

from agents.kube.config import Toleration
from agents.kube.decode import KNode, KPod, Usage, pod_usage
from agents.kube.nodes import (
    Rules,
    detect_provider,
    gfd_memory_mib,
    gpu_product_mismatch,
    gpu_state,
    is_ready,
    match_flavor,
    node_info,
    not_ready_since,
    notices,
    spot_signal,
    tolerates,
    untolerated_taints,
)
from agents.kube.signals import BUILTIN_NOTICE_TAINTS, NoticeTaint
from kinds.nodelabels import capacity_type_from_labels
from schemas.agent import MAX_GPUS_PER_NODE
from tests.kube.conftest import make_config, node, pod


def knode(obj: dict[str, object]) -> KNode:
    return msgspec.convert(obj, KNode)


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"karpenter.sh/capacity-type": "spot"}, "spot"),
        ({"karpenter.sh/capacity-type": "on-demand"}, "on-demand"),
        ({"karpenter.sh/capacity-type": "reserved"}, "on-demand"),
        ({"karpenter.sh/capacity-type": "spot", "cloud.google.com/gke-spot": "false"}, "spot"),
        ({"cloud.google.com/gke-spot": "true"}, "spot"),
        ({"cloud.google.com/gke-spot": "false"}, "on-demand"),
        ({"cloud.google.com/gke-preemptible": "true"}, "spot"),
        ({"cloud.google.com/gke-provisioning": "spot"}, "spot"),
        ({"cloud.google.com/gke-provisioning": "standard"}, "on-demand"),
        ({"kubernetes.azure.com/scalesetpriority": "spot"}, "spot"),
        ({"kubernetes.azure.com/scalesetpriority": "regular"}, "on-demand"),
        ({"eks.amazonaws.com/capacityType": "SPOT"}, "spot"),
        ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, "on-demand"),
        ({"eks.amazonaws.com/capacityType": "CAPACITY_BLOCK"}, "on-demand"),
        ({"cloud.google.com/gke-provisioning": "preemptible"}, "spot"),
        ({"pool": "a100"}, None),
    ],
)
def test_capacity_type_per_provider_key(labels: dict[str, str], expected: str | None) -> None:
    assert capacity_type_from_labels(labels) == expected


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
    # GFD says 8 GPUs, the device plugin registered only 7: missing, not proven failed.
    raw["status"]["capacity"]["nvidia.com/gpu"] = "7"
    raw["status"]["allocatable"]["nvidia.com/gpu"] = "7"
    st = gpu_state(knode(raw), cfg)
    assert (st.total, st.healthy, st.missing) == (8, None, 1)


def test_gpu_counts_above_the_schema_bound_are_clamped_and_said() -> None:
    cfg = make_config()
    bogus = knode(node("b", labels={"nvidia.com/gpu.count": "5000"}, gpu=9000))
    st = gpu_state(bogus, cfg)
    assert st.total == MAX_GPUS_PER_NODE and st.missing == 0
    assert "capacity nvidia.com/gpu=9000 above" in st.clamped
    assert "label nvidia.com/gpu.count=5000 above" in st.clamped
    assert gpu_state(knode(node("ok")), cfg).clamped == ""
    # Digits int() refuses ("²".isdigit() holds) are ignored, not a crash.
    odd = knode(node("o", labels={"nvidia.com/gpu.count": "²", "nvidia.com/gpu.memory": "²"}))
    assert gpu_state(odd, cfg).total == 8 and gfd_memory_mib(odd) == 0


def test_gpu_failure_needs_an_explicit_fault() -> None:
    cfg = make_config()
    ok = gpu_state(knode(node("n")), cfg)
    assert ok.total == 8 and ok.healthy is None and not ok.missing
    # A device-plugin restart withdraws GPUs from allocatable: a dip, never "failed".
    withdrawn = gpu_state(knode(node("n", allocatable_gpu=0)), cfg)
    assert (withdrawn.total, withdrawn.healthy, withdrawn.missing) == (8, None, 8)
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
    # Configuration adds to the built-in conditions; it does not replace them.
    custom = make_config(gpu_failure_conditions=["GpuBroken"])
    assert gpu_state(knode(cond), custom).healthy == 0
    broken = node("n", conditions=[{"type": "GpuBroken", "status": "True", "message": "Xid 13"}])
    assert gpu_state(knode(broken), custom).xid == 13
    assert gpu_state(knode(broken), cfg).healthy is None


def test_mig_nodes_are_not_failed_gpus_and_profiles_are_their_own_resource() -> None:
    cfg = make_config()
    mixed = node(
        "m",
        labels={"nvidia.com/gpu.count": "8", "nvidia.com/mig.strategy": "mixed"},
        gpu=4,
    )
    mixed["status"]["capacity"]["nvidia.com/mig-1g.10gb"] = "28"
    mixed["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = "28"
    st = gpu_state(knode(mixed), cfg)
    assert (st.total, st.healthy, st.missing) == (4, None, 0)  # 4 whole GPUs, none failed
    mig = gpu_state(knode(mixed), cfg, "nvidia.com/mig-1g.10gb")
    assert (mig.total, mig.healthy, mig.missing) == (28, None, 0)


@pytest.mark.parametrize("taint", BUILTIN_NOTICE_TAINTS, ids=lambda t: t.key)
def test_every_builtin_notice_taint_is_a_notice_without_configuration(
    taint: NoticeTaint,
) -> None:
    rules = Rules(make_config())
    raw = node("n", taints=[{"key": taint.key, "value": taint.value, "effect": "NoSchedule"}])
    (found,) = notices(knode(raw), rules, "aws")
    assert taint.key in found.reason and found.window_s == 120.0
    assert spot_signal(knode(raw), rules) == found.reason
    # Never an "untolerated taint" as well: it is read as the notice it is.
    assert untolerated_taints(knode(raw), make_config().flavors[1], rules) == []


def test_notice_values_times_and_configured_additions() -> None:
    rules = Rules(make_config())
    # Karpenter v1beta1's taint counts only with its value.
    other = node("n", taints=[{"key": "karpenter.sh/disruption", "value": "x"}])
    assert notices(knode(other), rules, "aws") == []
    # The Azure spot taint marks every spot node: a placement property, never a notice.
    azure = node("n", taints=[{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot"}])
    assert notices(knode(azure), rules, "azure") == []
    # Cluster Autoscaler writes the unix time into the value; NoExecute taints get timeAdded.
    ca = node("n", taints=[{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000"}])
    assert notices(knode(ca), rules, "gcp")[0].at == 1_700_000_000.0
    oos = node(
        "n",
        taints=[
            {
                "key": "node.kubernetes.io/out-of-service",
                "effect": "NoExecute",
                "timeAdded": "2023-11-14T22:13:20Z",
            }
        ],
    )
    assert notices(knode(oos), rules, "other")[0].at == 1_700_000_000.0
    # A deletion in progress is a notice, with its time; a cordon is not (no new pods only).
    raw = node("n")
    raw["spec"]["unschedulable"] = True
    raw["metadata"]["deletionTimestamp"] = "2023-11-14T22:13:20Z"
    found = notices(knode(raw), rules, "azure")
    assert [(n.reason, n.at, n.window_s) for n in found] == [
        ("node being deleted", 1_700_000_000.0, 30.0),
    ]
    # Configuration adds to the built-in ones, with its own window.
    custom = Rules(make_config(notice_taints=[{"key": "example.com/draining", "window_s": 600}]))
    mine = node("n", taints=[{"key": "example.com/draining", "effect": "NoSchedule"}])
    assert notices(knode(mine), rules, "aws") == []
    assert notices(knode(mine), custom, "aws")[0].window_s == 600
    assert notices(knode(node("n", taints=[{"key": "karpenter.sh/disrupted"}])), custom, "aws")


def test_untolerated_taints_are_not_capacity() -> None:
    cfg = make_config()
    rules = Rules(cfg)
    spot, od = cfg.flavors  # spot tolerates nvidia.com/gpu:NoSchedule, on-demand nothing
    gpu = knode(node("n", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]))
    assert untolerated_taints(gpu, spot, rules) == []
    assert untolerated_taints(gpu, od, rules) == ["nvidia.com/gpu:NoSchedule"]
    soft = knode(node("n", taints=[{"key": "x", "effect": "PreferNoSchedule"}]))
    assert untolerated_taints(soft, od, rules) == []
    ded = knode(node("n", taints=[{"key": "team", "value": "a", "effect": "NoExecute"}]))
    assert untolerated_taints(ded, od, rules) == ["team=a:NoExecute"]
    assert tolerates([Toleration(operator="Exists")], "team", "a", "NoExecute")
    assert not tolerates([Toleration(key="team", value="b")], "team", "a", "NoExecute")
    # The lifecycle controller's condition taints are read from the conditions instead.
    nr = knode(node("n", taints=[{"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]))
    assert untolerated_taints(nr, od, rules) == []


def test_gpu_product_must_agree_with_the_flavor() -> None:
    ok = [
        {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
        {"karpenter.k8s.aws/instance-gpu-name": "a100"},
        {},
    ]
    assert all(gpu_product_mismatch(labels, "A100") is None for labels in ok)
    bad = gpu_product_mismatch({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "a100")
    assert bad is not None and "NVIDIA-H100-80GB-HBM3" in bad
    assert gpu_product_mismatch({"nvidia.com/gpu.product": "x"}, "") is None


def test_not_ready_since_reads_the_condition_time() -> None:
    assert not_ready_since(knode(node("n"))) == (False, None)
    raw = node("n", ready=False)
    raw["status"]["conditions"][0]["lastTransitionTime"] = "2023-11-14T22:13:20Z"
    assert not_ready_since(knode(raw)) == (True, 1_700_000_000.0)
    raw["status"]["conditions"] = []
    assert not_ready_since(knode(raw)) == (True, None)


def test_ready_and_node_info() -> None:
    cfg = make_config()
    raw = node("n")
    n = knode(raw)
    assert is_ready(n)
    info = node_info(n, cfg.flavors[0], cfg, Usage(1, 2000, 3 * 2**30), 123.0)
    assert info.gpu == 8 and info.cpu_milli == 95_500 and info.memory == 1000 * 2**30
    assert (info.other_gpu, info.other_cpu_milli, info.other_memory) == (1, 2000, 3 * 2**30)
    assert info.spot_deadline == 123.0 and info.ready and not info.no_new_pods
    raw["spec"]["unschedulable"] = True
    assert not is_ready(knode(raw))
    assert not is_ready(knode(node("n", ready=False)))
    # Soft reasons take no new pods and say why; only `lost` says the replicas are gone.
    soft = node_info(n, cfg.flavors[0], cfg, Usage(), None, no_new_pods=["cordoned"])
    assert soft.ready and soft.no_new_pods and soft.note == "cordoned"
    assert not node_info(n, cfg.flavors[0], cfg, Usage(), None, lost=True).ready


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


def test_node_info_reports_allocatable_fabric_resources() -> None:
    cfg = make_config()
    raw = node("n")
    raw["status"]["allocatable"].update(
        {
            "vpc.amazonaws.com/efa": "32",
            "rdma/ib": "0",
            "hugepages-1Gi": "8Gi",
            "example.com/x": "1",
        }
    )
    info = node_info(knode(raw), cfg.flavors[0], cfg, Usage(), None)
    # rdma/ib at 0 is not offered; example.com/x is no fabric resource.
    assert info.extended == {"vpc.amazonaws.com/efa": 32, "hugepages-1Gi": 8 * 2**30}
    assert node_info(knode(node("m")), cfg.flavors[0], cfg, Usage(), None).extended == {}


def test_a_flavor_declares_fabric_resources_for_its_nodes() -> None:
    cfg = make_config()
    flavor = msgspec.structs.replace(cfg.flavors[0], node_extended={"vpc.amazonaws.com/efa": 32})
    assert flavor.info().node_extended == {"vpc.amazonaws.com/efa": 32}
    with pytest.raises(msgspec.ValidationError, match="extended"):
        msgspec.convert(
            {"name": "x", "capacity_type": "spot", "node_extended": {"google.com/tpu": 4}},
            type(flavor),
        )
