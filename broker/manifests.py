"""Derive a Muster JobSpec (the gang) from a Kubernetes manifest users already write.

Pure functions, no I/O. Supported kinds:

- Kubeflow training jobs (`kubeflow.org`): PyTorchJob (Master + Worker), MPIJob (Launcher +
  Worker; `slotsPerWorker` gives the GPUs per worker when the pod template asks for none),
  TFJob (Chief/Master/PS/Worker/Evaluator), and the same `<x>ReplicaSpecs` layout of XGBoostJob,
  PaddleJob and MXJob. One podset per replica type; `replicas` defaults to 1 and a replica type
  with `replicas: 0` is left out.
- Volcano Job (`batch.volcano.sh`): one podset per task.
- JobSet (`jobset.x-k8s.io`): one podset per replicatedJob, `replicas x parallelism` pods.
- batch/v1 Job: one podset `worker` of `min(parallelism, completions)` pods; a v1 Pod: one pod.

Per replica: GPUs from `resources.limits` (else `requests`) of every resource named
`<vendor>/gpu` (`nvidia.com/gpu`, `amd.com/gpu`); cpu and memory from `requests` (else
`limits`, which is what Kubernetes defaults a missing request to). Containers of a pod are summed;
init containers count as Kubernetes counts them (the larger of the sum of the containers plus
sidecars and the largest plain init container). A pod that asks for no cpu or memory gets 0, as
kube-scheduler counts it.

Gang semantics: Muster admits the whole gang or nothing. A Volcano `minAvailable` (or a Kubeflow
`runPolicy.schedulingPolicy.minAvailable`) smaller than the total is therefore NOT used to start
a partial gang: Muster reserves every replica, which is always enough to satisfy the smaller
minimum. The declared value is kept in the JobSpec label `muster.io/min-available` so nothing is
lost. Elastic PyTorchJobs (`elasticPolicy`) are admitted at their `replicas` count likewise.

Queue: the `queue` argument wins; otherwise the `kueue.x-k8s.io/queue-name` label, Volcano's
`spec.queue`, Kubeflow's `runPolicy.schedulingPolicy.queue`, or Koordinator's
`scheduling.x-k8s.io/queue` annotation, in that order.

Other JobSpec fields can be set with annotations on the manifest: `muster.io/capacity`,
`muster.io/priority` (also Koordinator's `scheduling.x-k8s.io/priority`), `muster.io/gpu-types`
(comma-separated), `muster.io/checkpoint-uri`, `muster.io/job-id`. Without them, a pod template
`nodeSelector` for spot capacity (`cloud.google.com/gke-provisioning: spot`,
`karpenter.sh/capacity-type: spot`, ...) sets `capacity: spot`, and a GPU-type selector
(`cloud.google.com/gke-accelerator`, `nvidia.com/gpu.product`, ...) sets `gpu_types`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import yaml

from schemas.fieldhints import explain
from schemas.job import MAX_GPU_PER_REPLICA, MAX_PODSETS, MAX_REPLICAS, JobSpec
from schemas.quantity import QuantityError, cpu_milli, memory_bytes, parse_quantity

__all__ = [
    "JobDocumentError",
    "ManifestError",
    "capacity_type_from_labels",
    "dns_label",
    "gpu_type_from_labels",
    "is_manifest",
    "jobspec_from_manifest",
    "load_job_document",
    "normalize_gpu_type",
]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KOORD_QUEUE_ANNOTATION = "scheduling.x-k8s.io/queue"
KOORD_PRIORITY_ANNOTATION = "scheduling.x-k8s.io/priority"
ANNOTATION_PREFIX = "muster.io/"
MIN_AVAILABLE_LABEL = "muster.io/min-available"
SOURCE_KIND_LABEL = "muster.io/source-kind"
NAMESPACE_LABEL = "muster.io/namespace"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")

# Kubeflow training operator v1 kinds and the key of their replica specs.
_KUBEFLOW_REPLICA_SPECS = {
    "PyTorchJob": "pytorchReplicaSpecs",
    "TFJob": "tfReplicaSpecs",
    "MPIJob": "mpiReplicaSpecs",
    "XGBoostJob": "xgbReplicaSpecs",
    "PaddleJob": "paddleReplicaSpecs",
    "MXJob": "mxReplicaSpecs",
}
# Podset order: the coordinating replica first, so `muster status` reads naturally.
_REPLICA_ORDER = ["launcher", "master", "chief", "scheduler", "server", "ps", "worker", "evaluator"]

SUPPORTED_KINDS = (
    "kubeflow.org/PyTorchJob, MPIJob, TFJob, XGBoostJob, PaddleJob, MXJob; "
    "batch.volcano.sh/Job; jobset.x-k8s.io/JobSet; batch/v1 Job; v1 Pod"
)

# Node labels that say which capacity type a node (or a selector) means.
_CAPACITY_LABELS: dict[str, dict[str, str]] = {
    "cloud.google.com/gke-provisioning": {"spot": "spot", "standard": "on-demand"},
    "cloud.google.com/gke-spot": {"true": "spot", "false": "on-demand"},
    "cloud.google.com/gke-preemptible": {"true": "spot", "false": "on-demand"},
    "karpenter.sh/capacity-type": {"spot": "spot", "on-demand": "on-demand"},
    "eks.amazonaws.com/capacityType": {"spot": "spot", "on_demand": "on-demand"},
    "kubernetes.azure.com/scalesetpriority": {"spot": "spot", "regular": "on-demand"},
    "node.kubernetes.io/lifecycle": {"spot": "spot", "normal": "on-demand"},
}
# Node labels that name the GPU model, most specific first.
_GPU_TYPE_LABELS = (
    "cloud.google.com/gke-accelerator",
    "nvidia.com/gpu.product",
    "karpenter.k8s.aws/instance-gpu-name",
    "k8s.amazonaws.com/accelerator",
    "accelerator",
)


class JobDocumentError(ValueError):
    """A job file (JobSpec or manifest) that cannot become a JobSpec; the text says how to fix
    it."""


class ManifestError(JobDocumentError):
    """A Kubernetes manifest Muster cannot derive a gang from; names the field path."""


# -- small helpers shared with broker.config ---------------------------------------------


def dns_label(text: str, max_length: int = 63) -> str:
    """Sanitise a Kubernetes object name into a DNS-1123 label (may return '')."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower())
    s = re.sub(r"-{2,}", "-", s).strip("-")
    return s[:max_length].rstrip("-")


def normalize_gpu_type(value: str) -> str:
    """`nvidia-tesla-a100`, `NVIDIA-A100-SXM4-80GB`, `a100` -> `a100`-style names.

    Lower-cases and drops vendor prefixes so one GPU model has one name whether it came from
    a GKE, NVIDIA GPU feature discovery or Karpenter label.
    """
    s = value.strip().lower().replace("_", "-").replace(" ", "-")
    for prefix in ("nvidia-tesla-", "nvidia-", "tesla-"):
        if s.startswith(prefix):
            s = s[len(prefix) :]
            break
    return s


def capacity_type_from_labels(labels: Mapping[str, Any]) -> str | None:
    """'spot' or 'on-demand' when a known provider label says so, else None."""
    for key, mapping in _CAPACITY_LABELS.items():
        value = labels.get(key)
        if value is None:
            continue
        found = mapping.get(str(value).strip().lower())
        if found is not None:
            return found
    return None


def gpu_type_from_labels(labels: Mapping[str, Any]) -> str | None:
    """The normalised GPU model named by a known node label, else None."""
    for key in _GPU_TYPE_LABELS:
        value = labels.get(key)
        if isinstance(value, str) and value.strip():
            return normalize_gpu_type(value)
    return None


def is_manifest(obj: object) -> bool:
    """A Kubernetes object (has `apiVersion` and `kind`), as opposed to a Muster JobSpec."""
    return (
        isinstance(obj, Mapping)
        and isinstance(obj.get("apiVersion"), str)
        and isinstance(obj.get("kind"), str)
    )


# -- resources ---------------------------------------------------------------------------


class _Demand:
    __slots__ = ("cpu", "gpu", "memory")

    def __init__(self, gpu: int = 0, cpu: int = 0, memory: int = 0) -> None:
        self.gpu = gpu
        self.cpu = cpu
        self.memory = memory

    def add(self, other: _Demand) -> None:
        self.gpu += other.gpu
        self.cpu += other.cpu
        self.memory += other.memory

    def maximum(self, other: _Demand) -> None:
        self.gpu = max(self.gpu, other.gpu)
        self.cpu = max(self.cpu, other.cpu)
        self.memory = max(self.memory, other.memory)


def _mapping(value: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None:
        if required:
            raise ManifestError(f"{path}: missing; add it (see the kind's documentation)")
        return {}
    if not isinstance(value, Mapping):
        raise ManifestError(f"{path}: expected a mapping, got {type(value).__name__}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ManifestError(f"{path}: expected a list, got {type(value).__name__}")
    return value


def _count(value: Any, path: str, default: int) -> int:
    """A replica/parallelism count: a non-negative whole number."""
    if value is None:
        return default
    count: int
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and value.strip().isdigit():
        count = int(value.strip())
    else:
        raise ManifestError(f"{path}: expected a whole number, got {value!r}")
    if count < 0:
        raise ManifestError(f"{path}: must not be negative, got {count}")
    return count


def _gpu_amount(value: Any, path: str) -> int:
    try:
        amount = parse_quantity(value)
    except QuantityError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    if amount != amount.to_integral_value():
        raise ManifestError(
            f"{path}: {value!r} is not a whole number of GPUs; GPUs are requested as whole "
            "devices, e.g. 1 or 8"
        )
    return int(amount)


def _container_demand(container: Any, path: str) -> _Demand:
    container = _mapping(container, path)
    resources = _mapping(container.get("resources"), f"{path}.resources")
    limits = _mapping(resources.get("limits"), f"{path}.resources.limits")
    requests = _mapping(resources.get("requests"), f"{path}.resources.requests")
    demand = _Demand()
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
                    raise ManifestError(f"{path}.resources.{where}.{name}: {exc}") from None
                break
    return demand


def _pod_demand(template: Any, path: str) -> _Demand:
    """Per-pod demand of a pod template (`{metadata, spec}`), as kube-scheduler counts it."""
    template = _mapping(template, path, required=True)
    spec = _mapping(template.get("spec"), f"{path}.spec", required=True)
    containers = _list(spec.get("containers"), f"{path}.spec.containers")
    if not containers:
        raise ManifestError(f"{path}.spec.containers: the pod template has no containers")
    total = _Demand()
    for i, c in enumerate(containers):
        total.add(_container_demand(c, f"{path}.spec.containers[{i}]"))
    init_peak = _Demand()
    for i, c in enumerate(_list(spec.get("initContainers"), f"{path}.spec.initContainers")):
        d = _container_demand(c, f"{path}.spec.initContainers[{i}]")
        if isinstance(c, Mapping) and c.get("restartPolicy") == "Always":
            total.add(d)  # a native sidecar runs beside the containers
        else:
            init_peak.maximum(d)
    total.maximum(init_peak)
    return total


def _node_selector(template: Any) -> Mapping[str, Any]:
    if not isinstance(template, Mapping):
        return {}
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return {}
    selector = spec.get("nodeSelector")
    return selector if isinstance(selector, Mapping) else {}


def _format_cpu(milli: int) -> str:
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _format_memory(n: int) -> str:
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


class _PodSetDraft:
    __slots__ = ("demand", "name", "path", "replicas", "template")

    def __init__(self, name: str, replicas: int, template: Any, path: str) -> None:
        self.name = name
        self.replicas = replicas
        self.template = template
        self.path = path
        self.demand = _pod_demand(template, f"{path}.template")


def _podset_name(raw: Any, path: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise ManifestError(f"{path}: a name is required")
    name = dns_label(raw)
    if not name:
        raise ManifestError(f"{path}: {raw!r} has no letters or digits to name a podset with")
    return name


# -- per kind ----------------------------------------------------------------------------


def _kubeflow(manifest: Mapping[str, Any], kind: str) -> tuple[list[_PodSetDraft], int | None]:
    key = _KUBEFLOW_REPLICA_SPECS[kind]
    spec = _mapping(manifest.get("spec"), "spec", required=True)
    replica_specs = _mapping(spec.get(key), f"spec.{key}", required=True)
    if not replica_specs:
        raise ManifestError(f"spec.{key}: empty; give at least one replica type, e.g. Worker")
    drafts: list[_PodSetDraft] = []
    for rtype, rspec in replica_specs.items():
        path = f"spec.{key}.{rtype}"
        rspec = _mapping(rspec, path)
        replicas = _count(rspec.get("replicas"), f"{path}.replicas", 1)
        if replicas == 0:
            continue
        drafts.append(
            _PodSetDraft(_podset_name(rtype, path), replicas, rspec.get("template"), path)
        )
    if kind == "MPIJob" and "slotsPerWorker" in spec:
        slots = _count(spec.get("slotsPerWorker"), "spec.slotsPerWorker", 1)
        launcher_works = bool(spec.get("runLauncherAsWorker", False))
        for d in drafts:
            if d.demand.gpu == 0 and (
                d.name == "worker" or (launcher_works and d.name == "launcher")
            ):
                d.demand.gpu = slots
    run_policy = _mapping(spec.get("runPolicy"), "spec.runPolicy")
    scheduling = _mapping(run_policy.get("schedulingPolicy"), "spec.runPolicy.schedulingPolicy")
    min_available = scheduling.get("minAvailable")
    order = {n: i for i, n in enumerate(_REPLICA_ORDER)}
    drafts.sort(key=lambda d: order.get(d.name, len(order)))
    return drafts, _count(min_available, "spec.runPolicy.schedulingPolicy.minAvailable", 0) or None


def _volcano(manifest: Mapping[str, Any]) -> tuple[list[_PodSetDraft], int | None]:
    spec = _mapping(manifest.get("spec"), "spec", required=True)
    tasks = _list(spec.get("tasks"), "spec.tasks")
    if not tasks:
        raise ManifestError("spec.tasks: a Volcano Job needs at least one task")
    drafts: list[_PodSetDraft] = []
    for i, task in enumerate(tasks):
        path = f"spec.tasks[{i}]"
        task = _mapping(task, path)
        replicas = _count(task.get("replicas"), f"{path}.replicas", 1)
        if replicas == 0:
            continue
        name = task.get("name") or ("default" if len(tasks) == 1 else None)
        drafts.append(
            _PodSetDraft(_podset_name(name, f"{path}.name"), replicas, task.get("template"), path)
        )
    min_available = _count(spec.get("minAvailable"), "spec.minAvailable", 0) or None
    return drafts, min_available


def _jobset(manifest: Mapping[str, Any]) -> tuple[list[_PodSetDraft], int | None]:
    spec = _mapping(manifest.get("spec"), "spec", required=True)
    rjobs = _list(spec.get("replicatedJobs"), "spec.replicatedJobs")
    if not rjobs:
        raise ManifestError("spec.replicatedJobs: a JobSet needs at least one replicatedJob")
    drafts: list[_PodSetDraft] = []
    for i, rjob in enumerate(rjobs):
        path = f"spec.replicatedJobs[{i}]"
        rjob = _mapping(rjob, path)
        replicas = _count(rjob.get("replicas"), f"{path}.replicas", 1)
        job_template = _mapping(rjob.get("template"), f"{path}.template", required=True)
        job_spec = _mapping(job_template.get("spec"), f"{path}.template.spec", required=True)
        pods = _job_pods(job_spec, f"{path}.template.spec")
        if replicas * pods == 0:
            continue
        drafts.append(
            _PodSetDraft(
                _podset_name(rjob.get("name"), f"{path}.name"),
                replicas * pods,
                job_spec.get("template"),
                f"{path}.template.spec",
            )
        )
    return drafts, None


def _job_pods(job_spec: Mapping[str, Any], path: str) -> int:
    """Pods of a batch/v1 Job that run at once: min(parallelism, completions)."""
    parallelism = _count(job_spec.get("parallelism"), f"{path}.parallelism", 1)
    completions = job_spec.get("completions")
    if completions is None:
        return parallelism
    return min(parallelism, _count(completions, f"{path}.completions", 1))


def _batch_job(manifest: Mapping[str, Any]) -> tuple[list[_PodSetDraft], int | None]:
    spec = _mapping(manifest.get("spec"), "spec", required=True)
    pods = _job_pods(spec, "spec")
    if pods == 0:
        return [], None
    return [_PodSetDraft("worker", pods, spec.get("template"), "spec")], None


def _pod(manifest: Mapping[str, Any]) -> tuple[list[_PodSetDraft], int | None]:
    return [_PodSetDraft("pod", 1, {"spec": manifest.get("spec")}, "")], None


def _dispatch_kind(manifest: Mapping[str, Any]) -> tuple[list[_PodSetDraft], int | None]:
    api_version = str(manifest.get("apiVersion", ""))
    kind = str(manifest.get("kind", ""))
    group = api_version.rpartition("/")[0]
    if group == "kubeflow.org" and kind in _KUBEFLOW_REPLICA_SPECS:
        return _kubeflow(manifest, kind)
    if group == "batch.volcano.sh" and kind == "Job":
        return _volcano(manifest)
    if group == "jobset.x-k8s.io" and kind == "JobSet":
        return _jobset(manifest)
    if api_version == "batch/v1" and kind == "Job":
        return _batch_job(manifest)
    if api_version == "v1" and kind == "Pod":
        return _pod(manifest)
    raise ManifestError(
        f"kind: {api_version} {kind} is not a job kind Muster can derive a gang from; "
        f"supported: {SUPPORTED_KINDS}. Otherwise write a Muster JobSpec with a `gang` list"
    )


# -- the JobSpec -------------------------------------------------------------------------


def _annotation_fields(annotations: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def text(key: str) -> str | None:
        value = annotations.get(key)
        return None if value is None else str(value).strip()

    capacity = text(ANNOTATION_PREFIX + "capacity")
    if capacity:
        out["capacity"] = capacity
    for key in (ANNOTATION_PREFIX + "priority", KOORD_PRIORITY_ANNOTATION):
        raw = text(key)
        if raw:
            try:
                out["priority"] = int(raw)
            except ValueError:
                raise ManifestError(
                    f"metadata.annotations[{key}]: {raw!r} is not a whole number; "
                    "write a priority like '10'"
                ) from None
            break
    gpu_types = text(ANNOTATION_PREFIX + "gpu-types")
    if gpu_types:
        out["gpu_types"] = [normalize_gpu_type(t) for t in gpu_types.split(",") if t.strip()]
    checkpoint = text(ANNOTATION_PREFIX + "checkpoint-uri")
    if checkpoint:
        out["checkpoint"] = {"uri": checkpoint}
    job_id = text(ANNOTATION_PREFIX + "job-id")
    if job_id:
        out["job_id"] = job_id
    return out


def _manifest_queue(manifest: Mapping[str, Any], metadata: Mapping[str, Any]) -> tuple[Any, str]:
    labels = _mapping(metadata.get("labels"), "metadata.labels")
    annotations = _mapping(metadata.get("annotations"), "metadata.annotations")
    spec = manifest.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    run_policy = spec.get("runPolicy")
    run_policy = run_policy if isinstance(run_policy, Mapping) else {}
    sched = run_policy.get("schedulingPolicy")
    candidates: list[tuple[Any, str]] = [
        (labels.get(QUEUE_LABEL), f"metadata.labels[{QUEUE_LABEL}]"),
    ]
    if str(manifest.get("apiVersion", "")).startswith("batch.volcano.sh/"):
        candidates.append((spec.get("queue"), "spec.queue"))
    if isinstance(sched, Mapping):
        candidates.append((sched.get("queue"), "spec.runPolicy.schedulingPolicy.queue"))
    candidates.append(
        (annotations.get(KOORD_QUEUE_ANNOTATION), f"metadata.annotations[{KOORD_QUEUE_ANNOTATION}]")
    )
    for value, where in candidates:
        if value not in (None, ""):
            return value, where
    return None, ""


def _check_queue(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > 63:
        raise ManifestError(
            f"{where}: {value!r} is not a valid queue name; queue names are DNS labels "
            "(lower-case letters, digits and '-'), e.g. 'ml-research'"
        )
    return value


def _check_limits(drafts: list[_PodSetDraft]) -> None:
    if len(drafts) > MAX_PODSETS:
        raise ManifestError(
            f"the manifest has {len(drafts)} replica types; Muster gangs hold at most "
            f"{MAX_PODSETS} podsets"
        )
    names = [d.name for d in drafts]
    for d in drafts:
        if names.count(d.name) > 1:
            raise ManifestError(
                f"{d.path}: two replica types map to the podset name {d.name!r}; rename one of them"
            )
        if d.replicas > MAX_REPLICAS:
            raise ManifestError(
                f"{d.path}: {d.replicas} replicas is over Muster's limit of {MAX_REPLICAS} "
                "per podset"
            )
        if d.demand.gpu > MAX_GPU_PER_REPLICA:
            raise ManifestError(
                f"{d.path}.template: {d.demand.gpu} GPUs per replica is over Muster's limit of "
                f"{MAX_GPU_PER_REPLICA}; no node has that many"
            )


def _selector_fields(drafts: list[_PodSetDraft]) -> dict[str, Any]:
    """capacity / gpu_types implied by the GPU podsets' nodeSelectors."""
    gpu_drafts = [d for d in drafts if d.demand.gpu > 0] or drafts
    capacities = {capacity_type_from_labels(_node_selector(d.template)) for d in gpu_drafts}
    out: dict[str, Any] = {}
    if len(capacities) == 1:
        (capacity,) = capacities
        if capacity is not None:
            out["capacity"] = capacity
    gpu_types = sorted(
        {t for d in gpu_drafts if (t := gpu_type_from_labels(_node_selector(d.template)))}
    )
    if gpu_types:
        out["gpu_types"] = gpu_types
    return out


def jobspec_from_manifest(
    manifest: dict[str, Any],
    *,
    queue: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> JobSpec:
    """Derive a JobSpec from a supported Kubernetes manifest.

    `defaults` holds JobSpec fields the manifest cannot express (e.g. `{"capacity": "spot",
    "checkpoint": {"uri": "s3://..."}}`); whatever the manifest says wins over them, and the
    `queue` argument wins over both. Raises ManifestError naming the field path.
    """
    if not is_manifest(manifest):
        raise ManifestError(
            "not a Kubernetes manifest: it needs `apiVersion` and `kind` (e.g. "
            "apiVersion: kubeflow.org/v1, kind: PyTorchJob)"
        )
    metadata = _mapping(manifest.get("metadata"), "metadata")
    raw_name = metadata.get("name") or metadata.get("generateName")
    if not isinstance(raw_name, str) or not raw_name:
        raise ManifestError("metadata.name: missing; give the job a name")
    name = dns_label(raw_name)
    if not name:
        raise ManifestError(f"metadata.name: {raw_name!r} has no letters or digits to keep")

    drafts, min_available = _dispatch_kind(manifest)
    if not drafts:
        raise ManifestError(
            "the manifest asks for no pods (every replica count is 0); set replicas >= 1"
        )
    _check_limits(drafts)

    fields: dict[str, Any] = dict(defaults or {})
    for key in ("gang", "workload", "name"):
        fields.pop(key, None)
    fields.update(_selector_fields(drafts))
    annotations = _mapping(metadata.get("annotations"), "metadata.annotations")
    fields.update(_annotation_fields(annotations))

    if queue is not None:
        fields["queue"] = _check_queue(queue, "queue")
    else:
        value, where = _manifest_queue(manifest, metadata)
        if value is not None:
            fields["queue"] = _check_queue(value, where)

    labels: dict[str, Any] = dict(fields.get("labels") or {})
    group = str(manifest["apiVersion"]).rpartition("/")[0] or "core"
    labels[SOURCE_KIND_LABEL] = f"{group}/{manifest['kind']}"
    namespace = metadata.get("namespace")
    if isinstance(namespace, str) and namespace:
        labels[NAMESPACE_LABEL] = namespace
    total = sum(d.replicas for d in drafts)
    if min_available is not None and min_available < total:
        labels[MIN_AVAILABLE_LABEL] = str(min_available)
    if min_available is not None and min_available > total:
        raise ManifestError(
            f"minAvailable is {min_available} but the job has only {total} pods; "
            f"lower minAvailable to at most {total}"
        )
    fields["labels"] = labels

    fields["name"] = name
    fields["gang"] = [
        {
            "name": d.name,
            "replicas": d.replicas,
            "gpu": d.demand.gpu,
            "cpu": _format_cpu(d.demand.cpu),
            "memory": _format_memory(d.demand.memory),
        }
        for d in drafts
    ]
    fields["workload"] = {"kind": "manifest", "manifest": manifest}
    try:
        return msgspec.convert(fields, JobSpec)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"the derived JobSpec is invalid: {_readable(exc)}") from None


def _readable(exc: msgspec.ValidationError) -> str:
    """msgspec's "Expected ... - at `$.gang[0].gpu`" as "gang[0].gpu: Expected ...", with
    "did you mean" for a misspelt JobSpec field."""
    return explain(str(exc), JobSpec)


# -- job files for the CLI ---------------------------------------------------------------


def _parse_document(text: str, source: str) -> Any:
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            pass  # fall through to YAML, which reports the position
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise JobDocumentError(f"{source}: not valid YAML or JSON{where}: {problem}") from None
    if not docs:
        raise JobDocumentError(f"{source}: the file is empty; write a JobSpec or a manifest")
    if len(docs) > 1:
        raise JobDocumentError(
            f"{source}: holds {len(docs)} YAML documents; put one job in each file"
        )
    return docs[0]


def load_job_document(
    text: str,
    *,
    queue: str | None = None,
    job_id: str | None = None,
    source: str = "job file",
) -> JobSpec:
    """A job file as the CLI reads it: YAML or JSON, a Muster JobSpec or a supported manifest.

    A JobSpec with `workload.manifest` and no `gang` gets its gang derived from the manifest.
    `queue` and `job_id` override what the document says.
    """
    doc = _parse_document(text, source)
    if not isinstance(doc, Mapping):
        raise JobDocumentError(
            f"{source}: expected a mapping (a JobSpec or a Kubernetes manifest), "
            f"got {type(doc).__name__}"
        )
    try:
        if is_manifest(doc):
            spec = jobspec_from_manifest(dict(doc), queue=queue)
        else:
            try:
                spec = msgspec.convert(doc, JobSpec)
            except msgspec.ValidationError as exc:
                raise JobDocumentError(f"invalid JobSpec: {_readable(exc)}") from None
            if not spec.gang and spec.workload.manifest is not None:
                derived = jobspec_from_manifest(spec.workload.manifest, queue=spec.queue)
                spec = msgspec.structs.replace(spec, gang=derived.gang)
            if queue is not None:
                spec = msgspec.structs.replace(spec, queue=_check_queue(queue, "queue"))
        if job_id is not None:
            if not _JOB_ID.match(job_id):
                raise JobDocumentError(
                    f"--job-id {job_id!r} is not valid: use letters, digits, '-' and '_', "
                    "at most 63 characters, starting with a letter or digit"
                )
            spec = msgspec.structs.replace(spec, job_id=job_id)
    except msgspec.ValidationError as exc:
        raise JobDocumentError(f"{source}: {_readable(exc)}") from None
    except JobDocumentError as exc:
        raise type(exc)(f"{source}: {exc}") from None
    return spec


def podset_summary(spec: JobSpec) -> Iterable[str]:
    """`master x1 (2 gpu, 8 cpu, 32Gi)` lines, for the CLI."""
    for p in spec.gang:
        yield f"{p.name} x{p.replicas} ({p.gpu} gpu, {p.cpu} cpu, {p.memory})"
