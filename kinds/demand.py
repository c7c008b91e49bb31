"""Per-pod demand of a pod template, as kube-scheduler counts it (pure).

Per replica: GPUs from `resources.limits` (else `requests`) of every resource named
`<vendor>/gpu` (`nvidia.com/gpu`, `amd.com/gpu`), never from kind-specific fields such as an
MPIJob's `slotsPerWorker`; hugepages and the fabric of multi-node training (EFA
`vpc.amazonaws.com/efa`, RDMA/InfiniBand device-plugin resources `rdma/...`) from `requests`
(else `limits`) into `extended` (hugepages in bytes), which the broker counts against each
node's capacity; any other extended resource (`google.com/tpu`, ...) is refused, as no cluster
offers it to Muster; cpu and memory from `requests` (else
`limits`, which is what Kubernetes defaults a missing request to). Containers of a pod are
summed, then init containers, native sidecars, pod-level `spec.resources.requests` and
`spec.overhead` count as kube-scheduler counts them (`kinds.requests`, the one function the
agent uses too). A pod that asks for no cpu or memory gets 0, as kube-scheduler counts it. The
RuntimeClass overhead is known only where the template carries it: the API server adds it at
admission, so the agent sees it on pods and the broker only when a manifest sets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kinds.base import KindError, listed, mapping
from kinds.requests import ContainerRequest, is_fabric, pod_requests
from schemas.quantity import QuantityError, cpu_milli, memory_bytes, parse_quantity


class Demand:
    __slots__ = ("cpu", "extended", "gpu", "memory")

    def __init__(
        self, gpu: int = 0, cpu: int = 0, memory: int = 0, extended: dict[str, int] | None = None
    ) -> None:
        self.gpu = gpu
        self.cpu = cpu
        self.memory = memory
        self.extended = extended or {}


_NATIVE = frozenset({"cpu", "memory", "ephemeral-storage", "storage", "pods"})


def _scheduled(resource: str) -> bool:
    """A resource Muster accounts for or the kubelet always has (never silently dropped), or a
    fabric resource that training nodes offer beside their GPUs (`is_fabric`, counted)."""
    return resource in _NATIVE or resource.endswith("/gpu") or is_fabric(resource)


def _fabric_amount(raw: Any, resource: str, path: str) -> int:
    try:
        if resource.startswith("hugepages-"):
            return memory_bytes(raw)
        amount = parse_quantity(raw)
    except QuantityError as exc:
        raise KindError(f"{path}: {exc}") from None
    if amount != amount.to_integral_value() or amount < 0:
        raise KindError(f"{path}: {raw!r} is not a whole count of {resource}, e.g. 1 or 32")
    return int(amount)


def _gpu_amount(value: Any, path: str) -> int:
    try:
        amount = parse_quantity(value)
    except QuantityError as exc:
        raise KindError(f"{path}: {exc}") from None
    if amount != amount.to_integral_value():
        raise KindError(
            f"{path}: {value!r} is not a whole number of GPUs; GPUs are requested as whole "
            "devices, e.g. 1 or 8"
        )
    return int(amount)


def container_demand(container: Any, path: str) -> Demand:
    container = mapping(container, path)
    resources = mapping(container.get("resources"), f"{path}.resources")
    limits = mapping(resources.get("limits"), f"{path}.resources.limits")
    requests = mapping(resources.get("requests"), f"{path}.resources.requests")
    demand = Demand()
    for source, where in ((limits, "limits"), (requests, "requests")):
        for key in source:
            if not _scheduled(str(key)):
                raise KindError(
                    f"{path}.resources.{where}[{key}]: {key} is not a resource any cluster "
                    "offers; Muster schedules GPUs (<vendor>/gpu), cpu and memory, and would "
                    "place the pod where none exists. Remove it, or run the job outside Muster"
                )
    for source, where in ((limits, "limits"), (requests, "requests")):
        gpu_keys = [k for k in source if isinstance(k, str) and k.endswith("/gpu")]
        if gpu_keys:
            demand.gpu = sum(
                _gpu_amount(source[k], f"{path}.resources.{where}[{k}]") for k in gpu_keys
            )
            break
    for name, parse in (("cpu", cpu_milli), ("memory", memory_bytes)):
        for source, where in ((requests, "requests"), (limits, "limits")):
            if name in source and source[name] is not None:
                raw = source[name]
                try:
                    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
                        raise QuantityError(f"expected a quantity like '4' or '16Gi', got {raw!r}")
                    setattr(demand, name, parse(raw))
                except QuantityError as exc:
                    raise KindError(f"{path}.resources.{where}.{name}: {exc}") from None
                break
    for source, where in ((limits, "limits"), (requests, "requests")):
        for key in source:  # requests win: for these the API server wants requests == limits
            if is_fabric(str(key)) and source[key] is not None:
                demand.extended[str(key)] = _fabric_amount(
                    source[key], str(key), f"{path}.resources.{where}[{key}]"
                )
    return demand


def _amounts(d: Demand) -> dict[str, int]:
    return {"gpu": d.gpu, "cpu": d.cpu, "memory": d.memory, **d.extended}


def _cpu_memory(raw: Any, path: str) -> dict[str, int]:
    """cpu and memory of a pod-level `resources.requests` or an `overhead` list."""
    found = mapping(raw, path)
    out: dict[str, int] = {}
    for name, parse in (("cpu", cpu_milli), ("memory", memory_bytes)):
        if found.get(name) is not None:
            try:
                out[name] = parse(found[name])
            except QuantityError as exc:
                raise KindError(f"{path}.{name}: {exc}") from None
    return out


def pod_demand(template: Any, path: str) -> Demand:
    """Per-pod demand of a pod template (`{metadata, spec}`), as kube-scheduler counts it
    (`kinds.requests.pod_requests`, shared with the agent)."""
    template = mapping(template, path, required=True)
    spec = mapping(template.get("spec"), f"{path}.spec", required=True)
    containers = listed(spec.get("containers"), f"{path}.spec.containers")
    if not containers:
        raise KindError(f"{path}.spec.containers: the pod template has no containers")
    main = [
        _amounts(container_demand(c, f"{path}.spec.containers[{i}]"))
        for i, c in enumerate(containers)
    ]
    init = [
        ContainerRequest(
            _amounts(container_demand(c, f"{path}.spec.initContainers[{i}]")),
            isinstance(c, Mapping) and c.get("restartPolicy") == "Always",
        )
        for i, c in enumerate(listed(spec.get("initContainers"), f"{path}.spec.initContainers"))
    ]
    level = mapping(spec.get("resources"), f"{path}.spec.resources")
    total = pod_requests(
        main,
        init,
        _cpu_memory(level.get("requests"), f"{path}.spec.resources.requests"),
        _cpu_memory(spec.get("overhead"), f"{path}.spec.overhead"),
    )
    extended = {k: v for k, v in total.items() if is_fabric(k) and v > 0}
    return Demand(total.get("gpu", 0), total.get("cpu", 0), total.get("memory", 0), extended)
