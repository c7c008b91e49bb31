"""Pure functions from a raw Node to what Muster needs: flavor, capacity type, provider,
spot notice, GPU health and `schemas.agent.NodeInfo`. No I/O, so each rule is tested alone."""

from __future__ import annotations

import re

import msgspec

from agents.kube.config import FlavorConfig, KubeBackendConfig, Provider
from agents.kube.decode import KNode, Usage, count_of, cpu_of, mem_of
from schemas.agent import NodeInfo
from schemas.job import CapacityType

# GPU Feature Discovery labels (NVIDIA GPU operator / k8s-device-plugin).
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"  # MiB per GPU
GFD_COUNT = "nvidia.com/gpu.count"

# Capacity-type labels, as each provider sets them.
KARPENTER_CAPACITY = "karpenter.sh/capacity-type"  # spot | on-demand | reserved
GKE_SPOT = "cloud.google.com/gke-spot"  # "true"
GKE_PREEMPTIBLE = "cloud.google.com/gke-preemptible"  # "true"
GKE_PROVISIONING = "cloud.google.com/gke-provisioning"  # spot | preemptible | standard
AZURE_PRIORITY = "kubernetes.azure.com/scalesetpriority"  # spot | regular
EKS_CAPACITY = "eks.amazonaws.com/capacityType"  # SPOT | ON_DEMAND | CAPACITY_BLOCK

_XID = re.compile(r"xid\D{0,3}(\d{1,4})", re.IGNORECASE)


def detect_capacity_type(labels: dict[str, str]) -> CapacityType | None:
    """Spot or on-demand from the provider's own node labels; None when no key is present."""
    v = labels.get(KARPENTER_CAPACITY)
    if v is not None:
        return "spot" if v.lower() == "spot" else "on-demand"
    v = labels.get(EKS_CAPACITY)
    if v is not None:
        return "spot" if v.upper() == "SPOT" else "on-demand"
    if labels.get(GKE_SPOT, "").lower() == "true":
        return "spot"
    if labels.get(GKE_PREEMPTIBLE, "").lower() == "true":
        return "spot"
    v = labels.get(GKE_PROVISIONING)
    if v is not None:
        return "spot" if v.lower() in ("spot", "preemptible") else "on-demand"
    v = labels.get(AZURE_PRIORITY)
    if v is not None:
        return "spot" if v.lower() == "spot" else "on-demand"
    if GKE_SPOT in labels:  # "false"
        return "on-demand"
    return None


def detect_provider(node: KNode) -> Provider:
    """The cloud, from spec.providerID first (aws://, gce://, azure://), then from labels."""
    pid = node.spec.providerID
    if pid.startswith("aws://"):
        return "aws"
    if pid.startswith("gce://"):
        return "gcp"
    if pid.startswith("azure://"):
        return "azure"
    for key in node.metadata.labels:
        if key.startswith(("eks.amazonaws.com/", "karpenter.k8s.aws/")):
            return "aws"
        if key.startswith("cloud.google.com/"):
            return "gcp"
        if key.startswith("kubernetes.azure.com/"):
            return "azure"
    return "other"


def match_flavor(node: KNode, flavors: list[FlavorConfig]) -> FlavorConfig | None:
    """The first flavor whose labels all match and whose capacity type agrees with the node's
    detected one (when detectable)."""
    labels = node.metadata.labels
    detected = detect_capacity_type(labels)
    for f in flavors:
        if detected is not None and detected != f.capacity_type:
            continue
        if all(labels.get(k) == v for k, v in f.node_labels.items()):
            return f
    return None


def spot_signal(node: KNode, spot_keys: list[str] | tuple[str, ...]) -> str | None:
    """The taint (or True condition) announcing the node's end, as a reason text; else None."""
    for t in node.spec.taints:
        if t.key in spot_keys:
            return f"taint {t.key}" + (f"={t.value}" if t.value else "")
    for c in node.status.conditions:
        if c.type in spot_keys and c.status == "True":
            return f"condition {c.type}" + (f": {c.reason}" if c.reason else "")
    return None


def _xid(*texts: str) -> int | None:
    for text in texts:
        if not text:
            continue
        if text.isdigit() and len(text) <= 4:
            return int(text)
        m = _XID.search(text)
        if m:
            return int(m.group(1))
    return None


class GpuState(msgspec.Struct, frozen=True):
    """`total` GPUs the node should have, `healthy` of them usable (None = all), why not."""

    total: int
    healthy: int | None = None
    xid: int | None = None
    reason: str = ""


def gpu_state(node: KNode, cfg: KubeBackendConfig) -> GpuState:
    """GPU health from three signals: the device plugin lowering allocatable below capacity
    (it withdraws unhealthy GPUs), GFD's `gpu.count` above capacity (a GPU fell off the bus),
    and the configured failure conditions/taints (XID), which mark every GPU unhealthy."""
    res = cfg.gpu_resource
    capacity = count_of(node.status.capacity, res)
    allocatable = count_of(node.status.allocatable, res)
    if res not in node.status.capacity:
        capacity = allocatable
    total = capacity
    gfd = node.metadata.labels.get(GFD_COUNT, "")
    if capacity > 0 and gfd.isdigit() and int(gfd) > capacity:
        total = int(gfd)
    for c in node.status.conditions:
        if c.type in cfg.gpu_failure_conditions and c.status == "True":
            return GpuState(
                total, 0, _xid(c.reason, c.message), f"condition {c.type}: {c.reason}".strip()
            )
    for t in node.spec.taints:
        if t.key in cfg.gpu_failure_taints:
            return GpuState(total, 0, _xid(t.value, t.key), f"taint {t.key}={t.value}")
    if allocatable < total:
        return GpuState(
            total, allocatable, None, f"{total - allocatable} of {total} GPUs not allocatable"
        )
    return GpuState(total)


def gfd_memory_mib(node: KNode) -> int:
    v = node.metadata.labels.get(GFD_MEMORY, "")
    return int(v) if v.isdigit() else 0


def is_ready(node: KNode) -> bool:
    """Ready condition True, not cordoned, not being deleted: can take a placement now."""
    if node.spec.unschedulable or node.metadata.deletionTimestamp:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)


def node_info(
    node: KNode,
    flavor: FlavorConfig,
    cfg: KubeBackendConfig,
    other: Usage,
    spot_deadline: float | None,
    gpu: GpuState | None = None,
) -> NodeInfo:
    """The node as the broker sees it. `gpu` is the device count the node should have; when
    some are unhealthy, `gpu_healthy` says how many still work."""
    g = gpu if gpu is not None else gpu_state(node, cfg)
    alloc = node.status.allocatable
    return NodeInfo(
        name=node.metadata.name,
        flavor=flavor.name,
        gpu=g.total,
        cpu_milli=cpu_of(alloc),
        memory=mem_of(alloc),
        gpu_healthy=g.healthy,
        ready=is_ready(node),
        spot_deadline=spot_deadline,
        other_gpu=other.gpu,
        other_cpu_milli=other.cpu_milli,
        other_memory=other.memory,
    )
