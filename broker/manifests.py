"""Derive a Muster JobSpec (the gang) from a Kubernetes manifest users already write.

Pure functions, no I/O. The kinds, and how each names its podsets, live in the `kinds` package
(one adapter per kind, shared with the agent, which pins the templates by the same names); see
docs/kinds.md. Per replica demand: `kinds.demand` (GPUs from requests/limits only).

Gang semantics: Muster admits the whole gang or nothing, unless the kind declares elasticity
(`Adapter.elastic`): a PyTorchJob's `elasticPolicy` (`minReplicas`/`maxReplicas` of the Worker),
a Volcano `minAvailable` below the job's pods when one podset holds the pods above it, and a batch
Job annotated `kueue.x-k8s.io/elastic-job: "true"` become a podset's `min_replicas` and
`max_replicas`. A Kubeflow `runPolicy.schedulingPolicy.minAvailable` (and a Volcano one no single
podset can take) is not used to start a partial gang: Muster reserves every replica, which is
always enough to satisfy the smaller minimum. A declared `minAvailable` is kept in the JobSpec
label `muster.dev/min-available` so nothing is lost.

Queue: the `queue` argument wins; otherwise the `kueue.x-k8s.io/queue-name` label,
Koordinator's `quota.scheduling.koordinator.sh/name` label, the kind's own queue field
(Volcano's `spec.queue`, Kubeflow's `runPolicy.schedulingPolicy.queue`), or Koordinator's
`scheduling.x-k8s.io/queue` annotation, in that order.

Priority class: Kueue's `kueue.x-k8s.io/priority-class` label, Volcano's `spec.priorityClassName`
or the pod templates' `priorityClassName` is kept as the label `muster.dev/priority-class`; the
broker sets the priority from its config's `priority_classes` (docs/compat.md).

Other JobSpec fields can be set with annotations on the manifest: `muster.dev/capacity`,
`muster.dev/priority` (also Koordinator's `scheduling.x-k8s.io/priority`), `muster.dev/gpu-types`
(comma-separated), `muster.dev/checkpoint-uri`, `muster.dev/job-id` (the older `muster.io/`
prefix is still read). Without them, a pod template `nodeSelector` for spot capacity
(`cloud.google.com/gke-provisioning: spot`, `karpenter.sh/capacity-type: spot`, ...) sets
`capacity: spot`, and a GPU-type selector (`cloud.google.com/gke-accelerator`,
`nvidia.com/gpu.product`, ...) sets `gpu_types`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import yaml

from broker.core.records import SPOT_OK_LABEL
from kinds.adapter import Adapter
from kinds.base import DOMAIN, LEGACY_DOMAIN, KindError, clip, mapping
from kinds.demand import pod_demand
from kinds.nodelabels import GPU_TYPE_SELECTOR_LABELS, capacity_type_from_labels
from kinds.podgroup import group_pods, grouped
from kinds.pods import PodPolicy, check_safety
from kinds.registry import adapter_of
from kinds.schema import check as check_fields
from kinds.topology import podset_topology
from schemas.fieldhints import explain
from schemas.job import MAX_GPU_PER_REPLICA, MAX_PODSETS, MAX_REPLICAS, JobSpec

__all__ = [
    "JobDocumentError",
    "ManifestError",
    "capacity_type_from_labels",
    "dns_label",
    "gpu_type_from_labels",
    "is_manifest",
    "jobspec_from_manifest",
    "load_job_document",
    "load_job_documents",
    "normalize_gpu_type",
]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KOORD_QUEUE_ANNOTATION = "scheduling.x-k8s.io/queue"
# Koordinator's ElasticQuota a pod is charged to (an imported quota is a Muster queue).
KOORD_QUOTA_LABEL = "quota.scheduling.koordinator.sh/name"
KOORD_PRIORITY_ANNOTATION = "scheduling.x-k8s.io/priority"
ANNOTATION_PREFIX = f"{DOMAIN}/"
LEGACY_ANNOTATION_PREFIX = f"{LEGACY_DOMAIN}/"
MIN_AVAILABLE_LABEL = f"{DOMAIN}/min-available"
SOURCE_KIND_LABEL = f"{DOMAIN}/source-kind"
NAMESPACE_LABEL = f"{DOMAIN}/namespace"
# The priority class a manifest names (pod `priorityClassName`, Kueue's WorkloadPriorityClass
# label, Volcano's `spec.priorityClassName`); the broker sets the job's priority from it.
PRIORITY_CLASS_LABEL = f"{DOMAIN}/priority-class"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# Fields no vendored schema knows, let through by `muster.dev/field-validation: Warn`.
UNKNOWN_FIELDS_LABEL = f"{DOMAIN}/unknown-fields"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_RESTARTS = 1000  # schemas.job.RestartPolicy.max_restarts_on_error
_PRIORITY_CLASS = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")


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


def gpu_type_from_labels(labels: Mapping[str, Any]) -> str | None:
    """The normalised GPU model named by a known node label, else None."""
    for key in GPU_TYPE_SELECTOR_LABELS:
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


# -- podsets ----------------------------------------------------------------------------


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    try:
        return mapping(value, path)
    except KindError as exc:
        raise ManifestError(str(exc)) from None


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
        self.demand = pod_demand(template, f"{path}.template" if path else "template")


def _drafts(manifest: Mapping[str, Any]) -> tuple[list[_PodSetDraft], int | None, Adapter]:
    """The podsets of a manifest, by its kind's adapter (the names the agent pins by)."""
    adapter = adapter_of(manifest)
    drafts: list[_PodSetDraft] = []
    by_name: dict[str, _PodSetDraft] = {}
    for t in adapter.templates(manifest):
        if not t.replicas:
            continue
        same = by_name.get(t.podset)
        if same is not None and t.template.get("spec") == same.template.get("spec"):
            same.replicas += t.replicas  # pods of one shape (a pod group)
            continue
        draft = _PodSetDraft(t.podset, t.replicas, t.template, t.path)
        drafts.append(draft)
        by_name.setdefault(t.podset, draft)
    order = {n: i for i, n in enumerate(adapter.order)}
    drafts.sort(key=lambda d: order.get(d.name, len(order)))
    return drafts, adapter.min_available(manifest), adapter


# -- the JobSpec -------------------------------------------------------------------------


def _annotation_fields(annotations: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def text(key: str) -> str | None:
        value = annotations.get(key)
        if value is None and key.startswith(ANNOTATION_PREFIX):
            value = annotations.get(LEGACY_ANNOTATION_PREFIX + key[len(ANNOTATION_PREFIX) :])
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


def _priority_class(
    manifest: Mapping[str, Any], metadata: Mapping[str, Any], drafts: list[_PodSetDraft]
) -> str | None:
    """The priority class the manifest names, as Kueue reads it: the WorkloadPriorityClass
    label first, then the kind's own `spec.priorityClassName` (Volcano), then the pod
    templates' `priorityClassName` (they must agree). The broker maps it to a priority."""
    labels = _mapping(metadata.get("labels"), "metadata.labels")
    spec = manifest.get("spec")
    candidates: list[tuple[Any, str]] = [
        (labels.get(KUEUE_PRIORITY_LABEL), f"metadata.labels[{KUEUE_PRIORITY_LABEL}]"),
        (
            spec.get("priorityClassName") if isinstance(spec, Mapping) else None,
            "spec.priorityClassName",
        ),
    ]
    for value, where in candidates:
        if value not in (None, ""):
            return _check_class(value, where)
    named: dict[str, str] = {}
    for d in drafts:
        pod = d.template.get("spec")
        value = pod.get("priorityClassName") if isinstance(pod, Mapping) else None
        if value not in (None, ""):
            where = f"{d.path}.template.spec.priorityClassName" if d.path else "spec"
            named.setdefault(_check_class(value, where), where)
    if len(named) > 1:
        listed = ", ".join(f"{where}: {name!r}" for name, where in named.items())
        raise ManifestError(
            f"the pod templates name different priority classes ({listed}); a gang has one "
            f"priority, so name one class (or set the label {KUEUE_PRIORITY_LABEL})"
        )
    return next(iter(named), None)


def _check_class(value: Any, where: str) -> str:
    return _checked_name(
        value,
        where,
        _PRIORITY_CLASS,
        253,
        "priority class name; write the name of a PriorityClass or WorkloadPriorityClass, "
        "e.g. 'high-priority'",
    )


def _checked_name(value: Any, where: str, pattern: re.Pattern[str], limit: int, what: str) -> str:
    if not isinstance(value, str) or not pattern.match(value) or len(value) > limit:
        raise ManifestError(f"{where}: {value!r} is not a valid {what}")
    return value


def _manifest_queue(
    manifest: Mapping[str, Any], metadata: Mapping[str, Any], adapter: Adapter
) -> tuple[Any, str]:
    labels = _mapping(metadata.get("labels"), "metadata.labels")
    annotations = _mapping(metadata.get("annotations"), "metadata.annotations")
    candidates: list[tuple[Any, str]] = [
        (labels.get(QUEUE_LABEL), f"metadata.labels[{QUEUE_LABEL}]"),
        (labels.get(KOORD_QUOTA_LABEL), f"metadata.labels[{KOORD_QUOTA_LABEL}]"),
    ]
    own = adapter.queue(manifest)
    if own is not None:
        candidates.append(own)
    candidates.append(
        (annotations.get(KOORD_QUEUE_ANNOTATION), f"metadata.annotations[{KOORD_QUEUE_ANNOTATION}]")
    )
    for value, where in candidates:
        if value not in (None, ""):
            return value, where
    return None, ""


def _check_queue(value: Any, where: str) -> str:
    return _checked_name(
        value,
        where,
        _DNS_LABEL,
        63,
        "queue name; queue names are DNS labels (lower-case letters, digits and '-'), "
        "e.g. 'ml-research'",
    )


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
    try:
        adapter = adapter_of(manifest)
        if grouped(manifest):  # one Pod of a Kueue pod group, sent on its own
            group_pods([manifest])
    except KindError as exc:
        raise ManifestError(str(exc)) from None
    refusal, warned = check_fields(manifest, adapter.resource.plural)
    if refusal is not None:
        raise ManifestError(refusal)
    metadata = _mapping(manifest.get("metadata"), "metadata")
    raw_name = metadata.get("name") or metadata.get("generateName")
    if not isinstance(raw_name, str) or not raw_name:
        raise ManifestError("metadata.name: missing; give the job a name")
    name = dns_label(raw_name)
    if not name:
        raise ManifestError(f"metadata.name: {raw_name!r} has no letters or digits to keep")

    try:
        drafts, min_available, _ = _drafts(manifest)
        min_pods = adapter.min_pods(manifest)
        elastic = adapter.elastic(manifest)
        kind_topology = adapter.topology(manifest)
        podset_levels = adapter.podset_topologies(manifest)
        # What no agent would run is refused at submission; the service-account allow-list
        # lives in each agent's configuration, so the agent checks that one.
        check_safety(manifest, PodPolicy(service_accounts=None))
    except KindError as exc:
        raise ManifestError(str(exc)) from None
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
    annotated = _annotation_fields(annotations)
    fields.update(annotated)
    retries = adapter.retries(manifest)
    if retries is not None:
        # The kind's own retries are turned off on the cluster; the author's count becomes
        # Muster's restart budget for the job's errors (the whole gang restarts).
        restart = dict(fields.get("restart") or {})
        restart["max_restarts_on_error"] = min(retries[0], MAX_RESTARTS)
        fields["restart"] = restart
    priority_class = _priority_class(manifest, metadata, drafts)

    if queue is not None:
        fields["queue"] = _check_queue(queue, "queue")
    else:
        value, where = _manifest_queue(manifest, metadata, adapter)
        if value is not None:
            fields["queue"] = _check_queue(value, where)

    labels: dict[str, Any] = dict(fields.get("labels") or {})
    group = str(manifest["apiVersion"]).rpartition("/")[0] or "core"
    labels[SOURCE_KIND_LABEL] = f"{group}/{manifest['kind']}"
    spot_ok = _mapping(metadata.get("labels"), "metadata.labels").get(SPOT_OK_LABEL)
    if spot_ok is not None:  # the manifest's word that spot is fine without a checkpoint
        labels[SPOT_OK_LABEL] = clip(str(spot_ok), 63)
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
    if priority_class is not None and "priority" not in annotated:
        labels[PRIORITY_CLASS_LABEL] = priority_class
    if warned:
        labels[UNKNOWN_FIELDS_LABEL] = clip(", ".join(p.path for p in warned), 1024)
    fields["labels"] = labels

    fields["name"] = name
    fields["gang"] = [
        {
            "name": d.name,
            "replicas": d.replicas,
            "gpu": d.demand.gpu,
            "cpu": _format_cpu(d.demand.cpu),
            "memory": _format_memory(d.demand.memory),
            **({"min_replicas": min_pods[d.name]} if d.name in min_pods else {}),
            **_elastic_fields(elastic.get(d.name)),
            **({"extended": d.demand.extended} if d.demand.extended else {}),
            **_podset_levels(podset_levels.get(d.name), podset_topology(d.template, d.path)),
        }
        for d in drafts
    ]
    if kind_topology:  # the manifest's own level wins over a default's
        fields["topology"] = {**(fields.get("topology") or {}), **kind_topology}
    fields["workload"] = {"kind": "manifest", "manifest": manifest}
    try:
        return msgspec.convert(fields, JobSpec)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"the derived JobSpec is invalid: {_readable(exc)}") from None


def with_manifest_checked(spec: JobSpec) -> JobSpec:
    """A JobSpec whose `workload.manifest` is checked as strictly as a manifest sent on its
    own (kind, fields against the kind's schema, pod safety, limits), so a bad one is refused
    at submission rather than by the API server at dispatch. A spec naming no `gang` gets the
    manifest's. Raises ManifestError naming the field path."""
    manifest = spec.workload.manifest
    if manifest is None:
        return spec
    derived = jobspec_from_manifest(manifest, queue=spec.queue)
    if spec.gang:
        return spec
    return msgspec.structs.replace(spec, gang=derived.gang)


def _podset_levels(kind: dict[str, str] | None, kueue: dict[str, Any]) -> dict[str, Any]:
    """A podset's `topology`: its kind's field (a JobSet replicatedJob's annotation), with
    Kueue's TAS annotations on the pod template winning where both name a level."""
    merged = {**(kind or {}), **kueue.get("topology", {})}
    return {"topology": merged} if merged else {}


def _elastic_fields(bounds: tuple[int, int] | None) -> dict[str, int]:
    """A podset's `min_replicas`/`max_replicas` from the kind's elasticity (`Adapter.elastic`)."""
    if bounds is None:
        return {}
    return {"min_replicas": bounds[0], "max_replicas": bounds[1]}


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
            f"{source}: holds {len(docs)} YAML documents; read it with load_job_documents"
        )
    return docs[0]


def load_job_documents(
    text: str,
    *,
    queue: str | None = None,
    job_id: str | None = None,
    source: str = "job file",
) -> list[JobSpec]:
    """A job file of one or more YAML documents: one JobSpec per job, and one per Kueue pod
    group (Pods sharing `kueue.x-k8s.io/pod-group-name` are one gang)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError:
        docs = []
    if len(docs) <= 1 and not (docs and grouped(docs[0])):
        return [load_job_document(text, queue=queue, job_id=job_id, source=source)]
    try:
        groups, rest = group_pods(docs)
    except KindError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    jobs = groups + rest
    if job_id is not None and len(jobs) > 1:
        raise JobDocumentError(
            f"{source}: holds {len(jobs)} jobs; --job-id names one, so drop it (each job gets "
            "its own id) or split the file"
        )
    out = []
    for i, doc in enumerate(jobs):
        where = f"{source} (job {i + 1} of {len(jobs)})"
        out.append(load_job_document(json.dumps(doc), queue=queue, job_id=job_id, source=where))
    return out


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
            spec = with_manifest_checked(spec)
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
