"""Every provider signal the kube agent reads, in one table, with where each is documented.

A node is in one of three states for Muster (see docs/kubernetes.md):
* takes no new pods: cordon, an untolerated NoSchedule/NoExecute taint, a deletion in progress,
  a NotReady shorter than the grace period, GPUs not allocatable, a GPU product that disagrees
  with the flavor, a node that left the node selector;
* going away: a notice with a deadline (the entries below, a deletionTimestamp, a pod
  `DisruptionTarget` for a node-level reason); handled like a spot notice. A plain cordon is
  not one (an operator's `kubectl cordon` keeps what runs); a cordon plus evictions is a drain;
* gone: only on proof (the Node deleted, NotReady past the grace period, an explicit GPU
  fault condition or taint; the gang's own pods failing or evicted are read from the pods).

The built-in entries hold with no configuration; `KubeBackendConfig.notice_taints` adds more.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Provider = Literal["aws", "gcp", "azure", "other"]
TimeSource = Literal["seen", "timeAdded", "value-unix"]


class NoticeTaint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A taint that means "this node is going away". `value` "" matches any value. The notice
    deadline is the signal's own time plus the window: `timeAdded` (set by the API server on
    NoExecute taints), `value-unix` (the taint's value is unix seconds), or `seen` (when the
    agent first saw it). `window_s` None = the node's provider window."""

    key: str
    value: str = ""
    window_s: float | None = None
    time: TimeSource = "seen"
    source: str = ""  # who sets it and where that is documented
    # The window on a node that is not spot, when the same taint means host maintenance
    # there (GKE GPU nodes); None = `window_s` on every node.
    maintenance_window_s: float | None = None

    def matches(self, key: str, value: str) -> bool:
        return key == self.key and (not self.value or value == self.value)


# Notice windows per provider when the signal carries none: EC2 spot interruption notices come
# two minutes ahead; GCE preemption gives 30 s; Azure Scheduled Events announce a spot eviction
# (Preempt) at least 30 s ahead.
DEFAULT_WINDOWS_S: dict[Provider, float] = {"aws": 120.0, "gcp": 30.0, "azure": 30.0, "other": 30.0}

# GKE's longest graceful termination of a GPU node for host maintenance.
GKE_GPU_MAINTENANCE_S = 3600.0

BUILTIN_NOTICE_TAINTS: tuple[NoticeTaint, ...] = (
    # Karpenter v1 termination controller: taints before draining a disrupted node (spot
    # interruption, consolidation, drift, expiry). karpenter-provider-aws
    # website/content/en/preview/concepts/disruption.md ("Add the karpenter.sh/disrupted:NoSchedule
    # taint").
    NoticeTaint("karpenter.sh/disrupted", source="Karpenter v1 (concepts/disruption)"),
    # Karpenter v0.32-v0.37 (v1beta1): designs/no-schedule-taint.md, `karpenter.sh/disruption=
    # disrupting:NoSchedule`.
    NoticeTaint(
        "karpenter.sh/disruption", "disrupting", source="Karpenter v1beta1 (no-schedule-taint)"
    ),
    # aws-node-termination-handler with taintNode: true, pkg/node/node.go: the value is the
    # event id, the effect NoSchedule.
    NoticeTaint("aws-node-termination-handler/spot-itn", source="NTH SpotInterruptionTaint"),
    NoticeTaint(
        "aws-node-termination-handler/rebalance-recommendation",
        source="NTH RebalanceRecommendationTaint",
    ),
    NoticeTaint(
        "aws-node-termination-handler/asg-lifecycle-termination",
        source="NTH ASGLifecycleTerminationTaint",
    ),
    NoticeTaint(
        "aws-node-termination-handler/scheduled-maintenance",
        source="NTH ScheduledMaintenanceTaint",
    ),
    # GKE node termination / maintenance handler: `cloud.google.com/impending-node-termination
    # :NoSchedule` before a spot VM is preempted or a GPU VM is stopped for maintenance.
    # On a spot node it is the preemption (the GCP window); on any other GPU node it is a host
    # maintenance event, whose graceful termination GKE lets run up to 60 minutes
    # (cloud.google.com/kubernetes-engine/docs/concepts/handle-disruption-gpu-tpu).
    NoticeTaint(
        "cloud.google.com/impending-node-termination",
        source="GKE graceful node termination",
        maintenance_window_s=GKE_GPU_MAINTENANCE_S,
    ),
    # AKS node auto-drain acts on the Azure Scheduled Events Preempt (spot pools) and Redeploy
    # only (learn.microsoft.com/azure/aks/node-auto-drain); Reboot and Terminate are not drained.
    NoticeTaint("remediator.kubernetes.azure.com/unschedulable", source="AKS node auto-drain"),
    # Cluster Autoscaler scale-down, utils/taints/taints.go: value = unix seconds when added.
    NoticeTaint(
        "ToBeDeletedByClusterAutoscaler",
        time="value-unix",
        source="Cluster Autoscaler scale-down",
    ),
    # Non-graceful node shutdown (kubernetes.io/docs/reference/labels-annotations-taints).
    NoticeTaint(
        "node.kubernetes.io/out-of-service", time="timeAdded", source="non-graceful shutdown"
    ),
)

# Pod `DisruptionTarget` condition reasons that may mean the NODE is going away (graceful node
# shutdown, the NoExecute taint manager, drains through the eviction API).
# `PreemptionByScheduler` is missing on purpose: it evicts one pod and the node stays.
BUILTIN_NODE_DISRUPTION_REASONS: tuple[str, ...] = (
    "TerminationByKubelet",
    "DeletionByTaintManager",
    "EvictionByEvictionAPI",
)
# Of those, the ones that also end single pods on a healthy node: the eviction API (descheduler,
# VPA, a PDB-aware rollout) and the kubelet (node-pressure eviction, critical-pod preemption
# as well as graceful node shutdown), per Kubernetes "Pod disruption conditions"
# (kubernetes.io/docs/concepts/workloads/pods/disruptions). They count for the node only on
# Muster's own pods, or with a signal on the node itself (a cordon: a drain; NotReady: a
# shutdown; a notice taint or a deletion).
POD_LEVEL_DISRUPTION_REASONS: frozenset[str] = frozenset(
    {"TerminationByKubelet", "EvictionByEvictionAPI"}
)

# Node conditions (status "True") that prove a GPU failed: NVIDIA NVSentinel's syslog monitor
# and common Node Problem Detector set-ups.
BUILTIN_GPU_FAILURE_CONDITIONS: tuple[str, ...] = (
    "SysLogsXIDError",
    "SysLogsSXIDError",
    "SysLogsGPUFallenOff",
    "GpuXidError",
)

# Taint keys with which remediation controllers quarantine a node for a GPU failure.
BUILTIN_GPU_FAILURE_TAINTS: tuple[str, ...] = (
    "nvidia.com/syslog-xid-error",
    "nvidia.com/gpu-xid-error",
    "nvidia.com/gpu.unhealthy",
)

# Taints the node lifecycle controller and kubelet set from conditions Muster reads directly
# (Ready, spec.unschedulable): not counted again as "untolerated".
CONDITION_TAINTS = frozenset(
    {
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/unschedulable",
    }
)
