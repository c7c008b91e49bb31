"""A manifest's nodeSelector and the node it selects are read by the one label table: the
capacity type and GPU model the broker derives from a selector are what the agent reads from a
node carrying the same label."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from agents.kube.config import FlavorConfig
from agents.kube.decode import KNode
from agents.kube.nodes import gpu_product_mismatch, match_flavor
from broker.manifests import jobspec_from_manifest
from kinds.nodelabels import CAPACITY_LABELS, GPU_TYPE_LABELS
from tests.kube.conftest import node

POOL = {"pool": "a100"}
FLAVORS = [
    FlavorConfig(name="spot", capacity_type="spot", node_labels=POOL),
    FlavorConfig(name="on-demand", capacity_type="on-demand", node_labels=POOL),
]


def job(selector: dict[str, str]) -> dict[str, Any]:
    """A one-pod GPU Job whose pod template selects nodes by `selector`."""
    container = {"name": "t", "image": "train", "resources": {"limits": {"nvidia.com/gpu": "8"}}}
    template = {
        "spec": {"restartPolicy": "Never", "nodeSelector": selector, "containers": [container]}
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train"},
        "spec": {"parallelism": 1, "completions": 1, "template": template},
    }


def knode(labels: dict[str, str]) -> KNode:
    return msgspec.convert(node("n1", labels={**POOL, **labels}), KNode)


@pytest.mark.parametrize(
    ("key", "value", "capacity"),
    [(k, v, c) for k, values in CAPACITY_LABELS.items() for v, c in values.items()],
)
def test_selector_capacity_is_the_nodes(key: str, value: str, capacity: str) -> None:
    # Providers spell values in their own case (EKS: SPOT); both sides take it as written.
    written = value.upper() if key.startswith("eks.") else value
    spec = jobspec_from_manifest(job({key: written}))
    flavor = match_flavor(knode({key: written}), FLAVORS)
    assert flavor is not None
    assert spec.capacity == flavor.capacity_type == capacity


@pytest.mark.parametrize(
    ("key", "value"),
    [(k, v) for k in GPU_TYPE_LABELS for v in ("nvidia-tesla-a100", "NVIDIA-A100-SXM4-80GB")],
)
def test_selector_gpu_type_is_the_nodes(key: str, value: str) -> None:
    spec = jobspec_from_manifest(job({key: value}))
    assert spec.gpu_types
    (gpu_type,) = spec.gpu_types
    assert gpu_product_mismatch({key: value}, gpu_type) is None
    assert gpu_product_mismatch({key: "nvidia-l4"}, gpu_type) is not None


def test_hand_made_accelerator_label_is_read_from_selectors_only() -> None:
    assert jobspec_from_manifest(job({"accelerator": "a100"})).gpu_types == ["a100"]
    assert gpu_product_mismatch({"accelerator": "nvidia"}, "a100") is None
