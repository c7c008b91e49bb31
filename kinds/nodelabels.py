"""The node labels that say a node's capacity type (spot or on-demand) and GPU model, as each
provider sets them. One table, read the same way by the agent (a Node's labels), the broker (a
manifest's `nodeSelector`) and the config importer (a Kueue ResourceFlavor's `nodeLabels`), so a
selector a user writes means what the agent sees on the node.

Sources (facts only; see docs/kinds.md "Node labels"):
- Karpenter well-known labels, `karpenter.sh/capacity-type`: `spot`, `on-demand`, `reserved`
  (karpenter.sh docs, "Scheduling" and "Utilizing On-Demand Capacity Reservations"; Apache-2.0).
- EKS managed node groups, `eks.amazonaws.com/capacityType`: `SPOT`, `ON_DEMAND`,
  `CAPACITY_BLOCK` (AWS EKS user guide and the CDK `CapacityType` enum; Apache-2.0 for CDK).
- GKE, `cloud.google.com/gke-spot=true`, `cloud.google.com/gke-preemptible=true`, and
  `cloud.google.com/gke-provisioning`: `spot`, `preemptible`, `standard` (cloud.google.com
  Kubernetes Engine docs, "Spot VMs" and "Preemptible VMs"; CC-BY-4.0).
- AKS, `kubernetes.azure.com/scalesetpriority`: `spot`, `regular` (learn.microsoft.com, "Add an
  Azure Spot node pool"; CC-BY-4.0).
- `node.kubernetes.io/lifecycle`: `spot`, `normal`, a community convention of self-managed
  groups (kops, eksctl); not set by a provider.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from schemas.job import CapacityType

# Label key -> {lower-cased value -> capacity type}. A value not listed says nothing.
CAPACITY_LABELS: Mapping[str, Mapping[str, CapacityType]] = MappingProxyType(
    {
        "karpenter.sh/capacity-type": {
            "spot": "spot",
            "on-demand": "on-demand",
            "reserved": "on-demand",  # a capacity reservation: never reclaimed as spot is
        },
        "eks.amazonaws.com/capacityType": {
            "spot": "spot",
            "on_demand": "on-demand",
            "capacity_block": "on-demand",
        },
        "cloud.google.com/gke-spot": {"true": "spot", "false": "on-demand"},
        "cloud.google.com/gke-preemptible": {"true": "spot", "false": "on-demand"},
        "cloud.google.com/gke-provisioning": {
            "spot": "spot",
            "preemptible": "spot",
            "standard": "on-demand",
        },
        "kubernetes.azure.com/scalesetpriority": {"spot": "spot", "regular": "on-demand"},
        "node.kubernetes.io/lifecycle": {"spot": "spot", "normal": "on-demand"},
    }
)

# Labels a provider or the NVIDIA GPU operator sets to the node's GPU model, most specific
# first: GKE (`nvidia-tesla-a100`), GPU Feature Discovery (`NVIDIA-A100-SXM4-80GB`), Karpenter
# on AWS (`a100`), the EKS GPU label the cluster autoscaler reads (`nvidia-tesla-v100`).
GPU_TYPE_LABELS: tuple[str, ...] = (
    "cloud.google.com/gke-accelerator",
    "nvidia.com/gpu.product",
    "karpenter.k8s.aws/instance-gpu-name",
    "k8s.amazonaws.com/accelerator",
)
# What a user's own selector may also name the GPU model by (Kueue's examples use a hand-made
# `accelerator` label). Not read from nodes: on a node it may mean anything.
GPU_TYPE_SELECTOR_LABELS: tuple[str, ...] = (*GPU_TYPE_LABELS, "accelerator")


def capacity_type_from_labels(labels: Mapping[str, Any]) -> CapacityType | None:
    """'spot' or 'on-demand' as the known provider labels say, None when none says. A label
    saying spot wins over one saying on-demand: spot is the capacity that can vanish."""
    found: CapacityType | None = None
    for key, values in CAPACITY_LABELS.items():
        value = labels.get(key)
        if value is None:
            continue
        said = values.get(str(value).strip().lower())
        if said == "spot":
            return "spot"
        found = found or said
    return found
