"""Pure functions from a raw Node to what Muster needs: flavor, capacity type, provider,
going-away notices, untolerated taints, readiness, GPU health and `schemas.agent.NodeInfo`.
No I/O and no clock, so each rule is tested alone; timers (grace, debounce) live in the
backend."""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from agents.kube.config import FlavorConfig, KubeBackendConfig, Provider, Toleration
from agents.kube.decode import KNode, Resources, Usage, count_of, cpu_of, mem_of, parse_time
from agents.kube.signals import (
    BUILTIN_GPU_FAILURE_CONDITIONS,
    BUILTIN_GPU_FAILURE_TAINTS,
    BUILTIN_NODE_DISRUPTION_REASONS,
    BUILTIN_NOTICE_TAINTS,
    CONDITION_TAINTS,
    POD_LEVEL_DISRUPTION_REASONS,
    NoticeTaint,
)
from kinds.nodelabels import GPU_TYPE_LABELS, capacity_type_from_labels
from kinds.requests import is_fabric
from schemas.agent import MAX_GPUS_PER_NODE, NodeInfo
from schemas.job import MAX_EXTENDED

# GPU Feature Discovery labels (NVIDIA GPU operator / k8s-device-plugin).
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"  # MiB per GPU
GFD_COUNT = "nvidia.com/gpu.count"
GFD_MIG_STRATEGY = "nvidia.com/mig.strategy"  # none | single | mixed
MIG_PREFIX = "nvidia.com/mig-"  # mixed strategy: one resource per MIG profile
NVIDIA_GPU = "nvidia.com/gpu"

_XID = re.compile(r"xid\D{0,3}(\d{1,4})", re.IGNORECASE)


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
    detected = capacity_type_from_labels(labels)
    for f in flavors:
        if detected is not None and detected != f.capacity_type:
            continue
        if all(labels.get(k) == v for k, v in f.node_labels.items()):
            return f
    return None


class Rules:
    """The signal tables of `agents.kube.signals` plus what the configuration adds, built
    once per backend."""

    def __init__(self, cfg: KubeBackendConfig) -> None:
        extra = [NoticeTaint(k) for k in cfg.spot_taints]
        extra += [NoticeTaint(t.key, t.value, t.window_s, t.time) for t in cfg.notice_taints]
        self.notice_taints: tuple[NoticeTaint, ...] = (*BUILTIN_NOTICE_TAINTS, *extra)
        self.notice_keys = frozenset(t.key for t in self.notice_taints)
        self.disruption_reasons = frozenset(
            (*BUILTIN_NODE_DISRUPTION_REASONS, *cfg.node_disruption_reasons)
        )
        self.gpu_failure_conditions = frozenset(
            (*BUILTIN_GPU_FAILURE_CONDITIONS, *cfg.gpu_failure_conditions)
        )
        self.gpu_failure_taints = frozenset((*BUILTIN_GPU_FAILURE_TAINTS, *cfg.gpu_failure_taints))
        self.windows = cfg.spot_deadlines_s
        self.gpu_resource = cfg.gpu_resource

    def resource(self, flavor: FlavorConfig) -> str:
        return flavor.gpu_resource or self.gpu_resource


class Notice(msgspec.Struct, frozen=True):
    """One "going away" signal: why, the signal's own time (None = when first seen) and the
    window after that time."""

    reason: str
    at: float | None
    window_s: float


def notices(node: KNode, rules: Rules, provider: Provider) -> list[Notice]:
    """Every going-away signal on the node: a deletion in progress, a notice taint, a True
    condition named like one. A cordon is not one: it only takes no new pods."""
    window = rules.windows.for_provider(provider)
    spot = capacity_type_from_labels(node.metadata.labels) == "spot"
    out: list[Notice] = []
    meta = node.metadata
    if meta.deletionTimestamp:
        out.append(Notice("node being deleted", parse_time(meta.deletionTimestamp), window))
    for t in node.spec.taints:
        for nt in rules.notice_taints:
            if nt.matches(t.key, t.value):
                at = None
                if nt.time == "timeAdded":
                    at = parse_time(t.timeAdded)
                elif nt.time == "value-unix" and t.value.isdigit():
                    at = float(t.value)
                text = f"taint {t.key}" + (f"={t.value}" if t.value else "")
                own = nt.window_s or window
                if nt.maintenance_window_s is not None and not spot:
                    text, own = text + " (host maintenance)", nt.maintenance_window_s
                out.append(Notice(text, at, own))
                break
    for c in node.status.conditions:
        if c.type in rules.notice_keys and c.status == "True":
            text = f"condition {c.type}" + (f": {c.reason}" if c.reason else "")
            out.append(Notice(text, parse_time(c.lastTransitionTime), window))
    return out


def counts_for_node(reason: str, own_pod: bool, node: KNode, found: list[Notice]) -> bool:
    """Whether a pod's node-level `DisruptionTarget` reason is a notice for its node: a
    pod-level one (an eviction, a kubelet termination) only on Muster's own pod or with a
    signal on the node itself (a cordon, NotReady, a notice)."""
    if reason not in POD_LEVEL_DISRUPTION_REASONS or own_pod:
        return True
    return bool(found) or node.spec.unschedulable or not_ready_since(node)[0]


def spot_signal(node: KNode, rules: Rules) -> str | None:
    """The first going-away signal on the node, as a reason text; else None."""
    found = notices(node, rules, "other")
    return found[0].reason if found else None


def tolerates(tolerations: list[Toleration], key: str, value: str, effect: str) -> bool:
    """Kubernetes' toleration match (an empty key with Exists tolerates everything)."""
    for t in tolerations:
        if t.effect and t.effect != effect:
            continue
        if not t.key and t.operator == "Exists":
            return True
        if t.key != key:
            continue
        if t.operator == "Exists" or t.value == value:
            return True
    return False


def untolerated_taints(node: KNode, flavor: FlavorConfig, rules: Rules) -> list[str]:
    """NoSchedule/NoExecute taints the flavor's pods would not tolerate: the node is no
    capacity for it. Notice, GPU-failure and condition taints are read elsewhere."""
    out = []
    for t in node.spec.taints:
        if t.effect not in ("NoSchedule", "NoExecute"):
            continue
        if (
            t.key in CONDITION_TAINTS
            or t.key in rules.notice_keys
            or t.key in rules.gpu_failure_taints
        ):
            continue
        if not tolerates(flavor.pod_tolerations(), t.key, t.value, t.effect):
            out.append(f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}")
    return out


def not_ready_since(node: KNode) -> tuple[bool, float | None]:
    """(not ready?, since when by the Ready condition's lastTransitionTime). A node without
    a Ready condition yet (just registered) counts as not ready."""
    for c in node.status.conditions:
        if c.type == "Ready":
            if c.status == "True":
                return False, None
            return True, parse_time(c.lastTransitionTime)
    return True, None


def _norm(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


def gpu_product_mismatch(labels: dict[str, str], gpu_type: str) -> str | None:
    """The GPU-model label that disagrees with the flavor's `gpu_type`, as a reason text.
    Loose on purpose: `a100` matches `NVIDIA-A100-SXM4-80GB` and `nvidia-tesla-a100`."""
    want = _norm(gpu_type)
    if not want:
        return None
    for key in GPU_TYPE_LABELS:
        have = labels.get(key)
        if have and want not in _norm(have):
            return f"{key}={have} is not the flavor's GPU type {gpu_type!r}"
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
    """`total` GPUs the node should have; `healthy` of them usable when an explicit fault
    says otherwise (None = all); `missing` not allocatable right now (a dip until proven
    otherwise: it only ever stops new pods)."""

    total: int
    healthy: int | None = None
    xid: int | None = None
    reason: str = ""
    missing: int = 0
    missing_reason: str = ""
    clamped: str = ""  # a count above the schema's bound, cut to it (bad input, not capacity)


def _partitioned(node: KNode) -> bool:
    """A MIG-partitioned node: GFD's gpu.count counts physical GPUs, not the devices the
    resources advertise, so it proves nothing about failed GPUs."""
    strategy = node.metadata.labels.get(GFD_MIG_STRATEGY, "none")
    if strategy not in ("", "none"):
        return True
    return any(k.startswith(MIG_PREFIX) for k in node.status.capacity)


def gpu_state(node: KNode, cfg: KubeBackendConfig | Rules, resource: str | None = None) -> GpuState:
    """GPU health. Only an explicit fault (a configured condition or taint, typically an XID)
    marks GPUs unhealthy; GPUs missing from allocatable (the device plugin withdraws them while
    it restarts) or GFD's `gpu.count` above capacity are reported as `missing`."""
    rules = cfg if isinstance(cfg, Rules) else Rules(cfg)
    res = resource or rules.gpu_resource
    raw = {
        f"capacity {res}": count_of(node.status.capacity, res),
        f"allocatable {res}": count_of(node.status.allocatable, res),
    }
    gfd = node.metadata.labels.get(GFD_COUNT, "")
    if gfd.isascii() and gfd.isdigit():  # "²".isdigit() holds, but int() refuses it
        raw[f"label {GFD_COUNT}"] = int(gfd)
    # One bogus count must not get the whole snapshot refused by the schema's bound.
    clamped = "; ".join(
        f"{k}={v} above {MAX_GPUS_PER_NODE}" for k, v in raw.items() if v > MAX_GPUS_PER_NODE
    )
    capacity, allocatable, *label = (min(v, MAX_GPUS_PER_NODE) for v in raw.values())
    if res not in node.status.capacity:
        capacity = allocatable
    total = capacity
    if (
        res == NVIDIA_GPU
        and capacity > 0
        and label
        and label[0] > capacity
        and not _partitioned(node)
    ):
        total = label[0]
    for c in node.status.conditions:
        if c.type in rules.gpu_failure_conditions and c.status == "True":
            return GpuState(
                total,
                0,
                _xid(c.reason, c.message),
                f"condition {c.type}: {c.reason}".strip(),
                clamped=clamped,
            )
    for t in node.spec.taints:
        if t.key in rules.gpu_failure_taints:
            return GpuState(
                total, 0, _xid(t.value, t.key), f"taint {t.key}={t.value}", clamped=clamped
            )
    if allocatable < total:
        return GpuState(
            total,
            missing=total - allocatable,
            missing_reason=f"{total - allocatable} of {total} {res} not allocatable",
            clamped=clamped,
        )
    return GpuState(total, clamped=clamped)


def gfd_memory_mib(node: KNode) -> int:
    v = node.metadata.labels.get(GFD_MEMORY, "")
    return int(v) if v.isascii() and v.isdigit() else 0


def is_ready(node: KNode) -> bool:
    """Ready condition True, not cordoned, not being deleted: can take a placement now."""
    if node.spec.unschedulable or node.metadata.deletionTimestamp:
        return False
    return not not_ready_since(node)[0]


def node_info(
    node: KNode,
    flavor: FlavorConfig,
    cfg: KubeBackendConfig | Rules,
    other: Usage,
    spot_deadline: float | None,
    gpu: GpuState | None = None,
    *,
    lost: bool = False,
    no_new_pods: list[str] | None = None,
    topology_levels: Sequence[str] = (),
) -> NodeInfo:
    """The node as the broker sees it. `gpu` is the device count the node should have; when
    an explicit fault says some are unhealthy, `gpu_healthy` says how many still work.
    `lost` (NotReady past its grace and tainted out-of-service) is the only way `ready` turns
    False; every softer reason
    goes to `no_new_pods` with a note."""
    rules = cfg if isinstance(cfg, Rules) else Rules(cfg)
    g = gpu if gpu is not None else gpu_state(node, rules, rules.resource(flavor))
    alloc = node.status.allocatable
    why = list(no_new_pods or ())
    return NodeInfo(
        name=node.metadata.name,
        flavor=flavor.name,
        gpu=g.total,
        cpu_milli=cpu_of(alloc),
        memory=mem_of(alloc),
        gpu_healthy=g.healthy,
        ready=not lost,
        spot_deadline=spot_deadline,
        other_gpu=other.gpu,
        other_cpu_milli=other.cpu_milli,
        other_memory=other.memory,
        no_new_pods=bool(why),
        note="; ".join(why)[:1024],
        topology=topology_of(node, topology_levels),
        extended=fabric_of(alloc),
    )


def fabric_of(alloc: Resources) -> dict[str, int]:
    """The node's allocatable fabric resources (EFA, rdma/..., hugepages-... in bytes), the
    first MAX_EXTENDED by name; what the node does not offer is left out."""
    names = sorted(k for k in alloc if is_fabric(k))[:MAX_EXTENDED]
    out = {
        k: mem_of({"memory": alloc[k]}) if k.startswith("hugepages-") else count_of(alloc, k)
        for k in names
    }
    return {k: v for k, v in out.items() if v > 0}


def topology_of(node: KNode, levels: Sequence[str]) -> tuple[str, ...]:
    """The node's label value per topology level, in order; "" where the label is missing
    (the broker keeps such a node out of placements that need that level)."""
    labels = node.metadata.labels
    return tuple(labels.get(level, "")[:253] for level in levels)
