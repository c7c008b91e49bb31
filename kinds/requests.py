"""A pod's effective request, as kube-scheduler counts it (pure): the one function the agent
(what pods hold on a node) and the broker's demand (what a pod template will need) share.

Ported from the rules of `PodRequests` / `AggregateContainerRequests` in Kubernetes'
component-helpers (`staging/src/k8s.io/component-helpers/resource/helpers.go`, kubernetes/
kubernetes, Apache-2.0), which follow the sidecar KEP (sig-node 753, "resources calculation for
scheduling and pod admission"), for the spec (the status-based in-place resize paths are left
out: a pod's spec is what Muster reads):

1. the containers' requests are summed;
2. init containers in order: a restartable one (a native sidecar, `restartPolicy: Always`) is
   added to that sum and to the running total of sidecars started so far; a regular one needs
   its own request plus every sidecar started before it (not after). The pod needs at least
   the largest of those, per resource: `max(sum, max over init containers)`;
3. pod-level `spec.resources.requests`, for the resources it may set (cpu, memory,
   hugepages-*), replace the containers' figure for those resources;
4. `spec.overhead` (set from the RuntimeClass at admission) is added.

Amounts are integers in each resource's unit (millicores, bytes, devices). A container's
missing request is its limit, which is what the API server defaults it to: callers pass the
defaulted requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

Amounts = dict[str, int]


class ContainerRequest(NamedTuple):
    requests: Mapping[str, int]
    sidecar: bool = False  # an init container with restartPolicy Always


EFA = "vpc.amazonaws.com/efa"


def is_fabric(resource: str) -> bool:
    """A fabric resource of multi-node training that Muster counts per node: EFA, RDMA
    device plugins (`rdma/...`), hugepages (`hugepages-<size>`, in bytes)."""
    return resource == EFA or resource.startswith(("rdma/", "hugepages-"))


def pod_level(resource: str) -> bool:
    """A resource `spec.resources` may set (component-helpers `IsSupportedPodLevelResource`)."""
    return resource in ("cpu", "memory") or resource.startswith("hugepages-")


def _add(into: Amounts, amounts: Mapping[str, int]) -> None:
    for k, v in amounts.items():
        into[k] = into.get(k, 0) + v


def _maximum(into: Amounts, amounts: Mapping[str, int]) -> None:
    for k, v in amounts.items():
        into[k] = max(v, into.get(k, 0))


def pod_requests(
    containers: Iterable[Mapping[str, int]],
    init_containers: Iterable[ContainerRequest] = (),
    pod_level_requests: Mapping[str, int] | None = None,
    overhead: Mapping[str, int] | None = None,
) -> Amounts:
    """The effective request of one pod (see the module docstring for the rules)."""
    total: Amounts = {}
    for requests in containers:
        _add(total, requests)
    sidecars: Amounts = {}
    init_peak: Amounts = {}
    for c in init_containers:
        if c.sidecar:
            _add(total, c.requests)
            _add(sidecars, c.requests)
            _maximum(init_peak, sidecars)
        else:
            need = dict(sidecars)
            _add(need, c.requests)
            _maximum(init_peak, need)
    _maximum(total, init_peak)
    if pod_level_requests:
        for k, v in pod_level_requests.items():
            if pod_level(k):
                total[k] = v
    if overhead:
        _add(total, overhead)
    return total
