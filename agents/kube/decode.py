"""Raw decoding of Kubernetes JSON (lists and watch lines) into small msgspec Structs.

Why not `V1Pod`/`V1Node`: the generated models cost ~400 µs an event to build; these Structs
hold only the fields the backend reads and decode in a few µs (see `decode_watch_line`).
The Structs are not tracked by the cyclic garbage collector (`gc=False`: decoded data holds
no cycles): a big cluster decodes millions of them, and every tracked one would lengthen the
collector's full passes, which stop the event loop. Every field has a default, unknown fields
are skipped, and a line that is not a watch event
yields None instead of an exception, so one bad line never stops a watch; likewise one bad item
never fails a list (`decode_list_lenient`).
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any, Generic, Literal, TypeVar

import msgspec

from kinds.requests import ContainerRequest, pod_requests
from schemas.quantity import QuantityError, cpu_milli, memory_bytes, parse_quantity

QuantityValue = str | int | float
Resources = dict[str, QuantityValue]


class KMeta(msgspec.Struct, gc=False):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    deletionTimestamp: str | None = None
    deletionGracePeriodSeconds: int | None = None


@lru_cache(maxsize=4096)
def parse_time(text: str | None) -> float | None:
    """An RFC 3339 timestamp of the API server ("2025-01-02T03:04:05Z") as unix seconds;
    None when absent or malformed (the caller falls back to when it saw the signal)."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


class KCondition(msgspec.Struct, gc=False):
    type: str = ""
    status: str = ""
    reason: str = ""
    message: str = ""
    lastTransitionTime: str | None = None


# -- nodes ----------------------------------------------------------------------------------


class KTaint(msgspec.Struct, gc=False):
    key: str = ""
    value: str = ""
    effect: str = ""
    timeAdded: str | None = None  # set by the API server on NoExecute taints


class KNodeSpec(msgspec.Struct, gc=False):
    taints: list[KTaint] = []
    unschedulable: bool = False
    providerID: str = ""


class KNodeStatus(msgspec.Struct, gc=False):
    capacity: Resources = {}
    allocatable: Resources = {}
    conditions: list[KCondition] = []


class KNode(msgspec.Struct, gc=False):
    metadata: KMeta = msgspec.field(default_factory=KMeta)
    spec: KNodeSpec = msgspec.field(default_factory=KNodeSpec)
    status: KNodeStatus = msgspec.field(default_factory=KNodeStatus)


# -- pods -----------------------------------------------------------------------------------


class KResources(msgspec.Struct, gc=False):
    requests: Resources = {}
    limits: Resources = {}


class KContainer(msgspec.Struct, gc=False):
    name: str = ""
    resources: KResources = msgspec.field(default_factory=KResources)
    restartPolicy: str = ""  # "Always" on an init container = a sidecar


class KPodSpec(msgspec.Struct, gc=False):
    nodeName: str = ""
    containers: list[KContainer] = []
    initContainers: list[KContainer] = []
    overhead: Resources = {}
    resources: KResources | None = None  # pod-level resources


class KTerminated(msgspec.Struct, gc=False):
    exitCode: int = 0
    reason: str = ""
    message: str = ""


class KContainerState(msgspec.Struct, gc=False):
    terminated: KTerminated | None = None


class KContainerStatus(msgspec.Struct, gc=False):
    name: str = ""
    state: KContainerState = msgspec.field(default_factory=KContainerState)
    # With restartPolicy OnFailure/Always a crash restarts the container inside the same pod
    # (the pod stays Running): the count and the last termination are the only trace of it.
    lastState: KContainerState = msgspec.field(default_factory=KContainerState)
    restartCount: int = 0


class KPodStatus(msgspec.Struct, gc=False):
    phase: str = ""
    reason: str = ""
    message: str = ""
    conditions: list[KCondition] = []
    containerStatuses: list[KContainerStatus] = []
    initContainerStatuses: list[KContainerStatus] = []


class KPod(msgspec.Struct, gc=False):
    metadata: KMeta = msgspec.field(default_factory=KMeta)
    spec: KPodSpec = msgspec.field(default_factory=KPodSpec)
    status: KPodStatus = msgspec.field(default_factory=KPodStatus)


# -- generic objects (workload objects we created) ------------------------------------------


class KObject(msgspec.Struct, gc=False):
    apiVersion: str = ""
    kind: str = ""
    metadata: KMeta = msgspec.field(default_factory=KMeta)


class KJob(msgspec.Struct, gc=False):
    """A workload object Muster created whose status says how it ended (batch/v1 Job,
    Kubeflow jobs, JobSet, Volcano Job). `status` stays raw and is decoded on its own by
    `decode_job_status`: operators' CRD statuses are loosely validated, and one object whose
    status does not decode must be skipped alone, not fail a whole list or watch."""

    apiVersion: str = ""
    kind: str = ""
    metadata: KMeta = msgspec.field(default_factory=KMeta)
    status: msgspec.Raw = msgspec.Raw(b"null")


class KVolcanoState(msgspec.Struct, gc=False):
    """A Volcano Job's `status.state` (phase: Pending, Running, Restarting, Completing,
    Completed, Aborting, Aborted, Terminating, Terminated, Failed)."""

    phase: str = ""
    reason: str = ""
    message: str = ""


class KJobStatus(msgspec.Struct, gc=False):
    """The fields of a workload object's status that decide its verdict: `conditions`
    (batch/v1, Kubeflow, JobSet) and Volcano's `state`."""

    conditions: list[KCondition] | None = None
    state: KVolcanoState | None = None
    # KubeRay RayJob
    jobStatus: str = ""
    jobDeploymentStatus: str = ""
    reason: str = ""
    message: str = ""


_job_status_decoder = msgspec.json.Decoder(KJobStatus | None)


def decode_job_status(raw: msgspec.Raw) -> KJobStatus | None:
    """The status of a `KJob`; an absent or null status is empty, a malformed one is None."""
    try:
        st = _job_status_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return KJobStatus() if st is None else st


class KStatus(msgspec.Struct, gc=False):
    """A metav1.Status (the object of an ERROR watch event, or an error response body)."""

    code: int = 0
    reason: str = ""
    message: str = ""


class KListMeta(msgspec.Struct, gc=False):
    resourceVersion: str = ""
    # `continue` is a Python keyword, hence the rename.
    continue_: str = msgspec.field(default="", name="continue")


# -- autoscalers: Karpenter NodePools and NodeClaims, ProvisioningRequests (agents/kube/pools.py)


class KRequirement(msgspec.Struct, gc=False):
    key: str = ""
    operator: str = ""
    values: list[str] = []


class KTemplateMeta(msgspec.Struct, gc=False):
    labels: dict[str, str] = {}


class KTemplateSpec(msgspec.Struct, gc=False):
    requirements: list[KRequirement] = []
    taints: list[KTaint] = []


class KTemplate(msgspec.Struct, gc=False):
    metadata: KTemplateMeta = msgspec.field(default_factory=KTemplateMeta)
    spec: KTemplateSpec = msgspec.field(default_factory=KTemplateSpec)


class KNodePoolSpec(msgspec.Struct, gc=False):
    template: KTemplate = msgspec.field(default_factory=KTemplate)
    limits: Resources = {}
    weight: int = 0


class KNodePool(msgspec.Struct, gc=False):
    metadata: KMeta = msgspec.field(default_factory=KMeta)
    spec: KNodePoolSpec = msgspec.field(default_factory=KNodePoolSpec)


class KClaimResources(msgspec.Struct, gc=False):
    requests: Resources = {}


class KNodeClaimSpec(msgspec.Struct, gc=False):
    resources: KClaimResources = msgspec.field(default_factory=KClaimResources)


class KNodeClaimStatus(msgspec.Struct, gc=False):
    nodeName: str = ""
    capacity: Resources = {}


class KNodeClaim(msgspec.Struct, gc=False):
    metadata: KMeta = msgspec.field(default_factory=KMeta)
    spec: KNodeClaimSpec = msgspec.field(default_factory=KNodeClaimSpec)
    status: KNodeClaimStatus = msgspec.field(default_factory=KNodeClaimStatus)


class KProvStatus(msgspec.Struct, gc=False):
    conditions: list[KCondition] = []


class KProvisioningRequest(msgspec.Struct, gc=False):
    metadata: KMeta = msgspec.field(default_factory=KMeta)
    status: KProvStatus = msgspec.field(default_factory=KProvStatus)


T = TypeVar("T", KNode, KPod, KObject, KJob, KNodePool, KNodeClaim, KProvisioningRequest)


class KList(msgspec.Struct, Generic[T], gc=False):
    metadata: KListMeta = msgspec.field(default_factory=KListMeta)
    items: list[T] | None = None


EventType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]


class WatchEvent(msgspec.Struct, Generic[T], gc=False):
    """One decoded watch line. `obj` is None for ERROR (see `error`) and holds only metadata
    for BOOKMARK."""

    type: str = ""
    object: T | None = None


class _StatusEvent(msgspec.Struct, gc=False):
    type: str = ""
    object: KStatus | None = None


class Decoded(msgspec.Struct, Generic[T], gc=False):
    type: str
    obj: T | None = None
    error: KStatus | None = None

    @property
    def resource_version(self) -> str:
        return self.obj.metadata.resourceVersion if self.obj is not None else ""


_event_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_status_event_decoder = msgspec.json.Decoder(_StatusEvent)
_status_decoder = msgspec.json.Decoder(KStatus)
_list_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def _event_decoder(kind: type[T]) -> msgspec.json.Decoder[WatchEvent[T]]:
    dec = _event_decoders.get(kind)
    if dec is None:
        dec = _event_decoders[kind] = msgspec.json.Decoder(WatchEvent[kind])  # type: ignore[valid-type]
    return dec


def decode_watch_line(line: bytes, kind: type[T] = KPod) -> Decoded[T] | None:  # type: ignore[assignment]
    """Decode one line of a watch stream (one JSON object) into a `Decoded` event.

    Returns None for anything that is not a watch event (blank line, garbage, wrong shape).
    An ERROR event carries its metav1.Status in `error` (410 = resourceVersion too old).
    """
    if not line or line.isspace():
        return None
    try:
        ev = _event_decoder(kind).decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError):
        ev = None
    if ev is not None and ev.type != "ERROR":
        if not ev.type:
            return None
        return Decoded(type=ev.type, obj=ev.object)
    # An ERROR event's object is a Status whose `status` field is a string, so the typed
    # decode above either failed or produced a meaningless object: decode it as a Status.
    try:
        sev = _status_event_decoder.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if sev.type != "ERROR":
        return None
    return Decoded(type="ERROR", error=sev.object or KStatus())


def decode_list(body: bytes, kind: type[T]) -> KList[T]:
    """Decode a list response; raises msgspec.DecodeError/ValidationError on a bad body."""
    dec = _list_decoders.get(kind)
    if dec is None:
        dec = _list_decoders[kind] = msgspec.json.Decoder(KList[kind])  # type: ignore[valid-type]
    page: KList[T] = dec.decode(body)
    return page


class _RawList(msgspec.Struct, gc=False):
    metadata: KListMeta = msgspec.field(default_factory=KListMeta)
    items: list[msgspec.Raw] | None = None


_raw_list_decoder = msgspec.json.Decoder(_RawList)
_item_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def decode_list_lenient(body: bytes, kind: type[T]) -> tuple[KList[T], int]:
    """`decode_list`, except that items which do not decode are skipped: (page, skipped).
    The fast path is one typed decode; only a page with a bad item is decoded item by item.
    A body that is not a list at all still raises."""
    try:
        return decode_list(body, kind), 0
    except msgspec.ValidationError:
        pass
    raw = _raw_list_decoder.decode(body)
    dec = _item_decoders.get(kind)
    if dec is None:
        dec = _item_decoders[kind] = msgspec.json.Decoder(kind)
    items: list[T] = []
    skipped = 0
    for item in raw.items or []:
        try:
            items.append(dec.decode(item))
        except (msgspec.ValidationError, msgspec.DecodeError):
            skipped += 1
    return KList(metadata=raw.metadata, items=items), skipped


def decode_status(body: bytes) -> KStatus:
    """Best-effort metav1.Status from an error response body."""
    try:
        return _status_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return KStatus(message=body[:512].decode("utf-8", "replace"))


# -- quantities -----------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _cpu(value: QuantityValue) -> int:
    try:
        return cpu_milli(value)
    except QuantityError:
        return 0


@lru_cache(maxsize=4096)
def _count(value: QuantityValue) -> int:
    """Extended resources (GPUs) are whole numbers; round anything else down."""
    try:
        return int(parse_quantity(value))
    except QuantityError:
        return 0


@lru_cache(maxsize=4096)
def _mem(value: QuantityValue) -> int:
    try:
        return memory_bytes(value)
    except QuantityError:
        return 0


def cpu_of(res: Resources) -> int:
    v = res.get("cpu")
    return 0 if v is None else _cpu(v)


def mem_of(res: Resources) -> int:
    v = res.get("memory")
    return 0 if v is None else _mem(v)


def count_of(res: Resources, name: str) -> int:
    v = res.get(name)
    return 0 if v is None else _count(v)


class Usage(msgspec.Struct, frozen=True):
    """What one pod (or a sum of pods) requests: GPUs, millicores, bytes."""

    gpu: int = 0
    cpu_milli: int = 0
    memory: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.gpu + other.gpu, self.cpu_milli + other.cpu_milli, self.memory + other.memory
        )

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            max(0, self.gpu - other.gpu),
            max(0, self.cpu_milli - other.cpu_milli),
            max(0, self.memory - other.memory),
        )


ZERO = Usage()


def _container_usage(c: KContainer, gpu_resource: str) -> tuple[int, int, int]:
    req, lim = c.resources.requests, c.resources.limits
    # A missing request defaults to the limit (the API server does the same for
    # extended resources, and for cpu/memory when only limits are set).
    gpu = count_of(req, gpu_resource) if gpu_resource in req else count_of(lim, gpu_resource)
    cpu = cpu_of(req) if "cpu" in req else cpu_of(lim)
    mem = mem_of(req) if "memory" in req else mem_of(lim)
    return gpu, cpu, mem


def _amounts(c: KContainer, gpu_resource: str) -> dict[str, int]:
    gpu, cpu, mem = _container_usage(c, gpu_resource)
    return {"gpu": gpu, "cpu": cpu, "memory": mem}


def pod_usage(pod: KPod, gpu_resource: str = "nvidia.com/gpu") -> Usage:
    """A pod's effective request as kube-scheduler counts it (`kinds.requests.pod_requests`:
    containers, native sidecars, init containers, pod-level resources, RuntimeClass overhead).
    The common pod (containers only) takes a short path with the same result."""
    spec = pod.spec
    if not spec.initContainers and spec.resources is None and not spec.overhead:
        g = c = m = 0
        for ct in spec.containers:
            cg, cc, cm = _container_usage(ct, gpu_resource)
            g, c, m = g + cg, c + cc, m + cm
        return Usage(g, c, m)
    level = spec.resources.requests if spec.resources is not None else {}
    total = pod_requests(
        (_amounts(ct, gpu_resource) for ct in spec.containers),
        (
            ContainerRequest(_amounts(ct, gpu_resource), ct.restartPolicy == "Always")
            for ct in spec.initContainers
        ),
        {k: v for k, v in (("cpu", cpu_of(level)), ("memory", mem_of(level))) if k in level},
        {
            "gpu": count_of(spec.overhead, gpu_resource),
            "cpu": cpu_of(spec.overhead),
            "memory": mem_of(spec.overhead),
        },
    )
    return Usage(total.get("gpu", 0), total.get("cpu", 0), total.get("memory", 0))
