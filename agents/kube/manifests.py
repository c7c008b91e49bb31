"""Pure builders: a `Dispatch` plus its flavor become the Kubernetes objects of one attempt.

No I/O here; `build_workload` returns plain dicts ready to POST, so every rule below is tested
directly.

Placement (how the broker's per-replica node assignment is honoured)
---------------------------------------------------------------------
Kubernetes has one pod template per Indexed Job, per Kubeflow replica type, per Volcano task
and per JobSet replicated job, so a node cannot be pinned per index. For each template we set:

* `nodeSelector` += the flavor's `node_labels`, `tolerations` += the flavor's tolerations;
* a REQUIRED node affinity `matchFields: metadata.name In <the template's assigned nodes>`
  (the node *name*, as the DaemonSet controller does; the hostname label can differ from the
  name on some clouds). When the template already has required terms, our field requirement is
  added to each term, so the user's terms still hold (terms are ORed, requirements ANDed);
* when the template's replicas were assigned to pairwise-distinct nodes, a required
  `podAntiAffinity` on `kubernetes.io/hostname` against pods of the same job, attempt and
  podset, so the scheduler maps exactly one replica to each assigned node, i.e. exactly the
  broker's assignment up to which index lands on which node (ranks come from the index, not
  the node, so that does not matter). When several replicas share a node (e.g. 2 x 4 GPUs on
  one 8-GPU node) no anti-affinity is set; the scheduler packs identical replicas into the
  assigned set, which always fits for identical replicas since the broker checked capacity.

Manifests whose templates cannot be matched to a podset by name fall back to the union of all
assigned nodes, without anti-affinity.

Labels, annotations and environment
-----------------------------------
Every object and pod template carries `muster.dev/job-id` (a label-safe form of the id),
`muster.dev/attempt`, `app.kubernetes.io/managed-by=muster`, and pods `muster.dev/podset`.
Pod templates carry annotations with the exact job id, the gang's total replica count and
whether the replica type decides success (Master/Launcher/Chief), so the backend can rebuild
a workload's status from its pods alone after a restart. Every container (and init container)
gets MUSTER_JOB_ID, MUSTER_ATTEMPT, MUSTER_CHECKPOINT_URI, MUSTER_RESUME_FROM,
MUSTER_RESUME_STEP and MUSTER_PODINFO_DIR (a downward-API volume with the pod's annotations,
where the `muster.dev/checkpoint-request` annotation appears; see docs in backend.py).

Muster owns retries: generated and patched objects get `backoffLimit: 0` (batch Job, Kubeflow
runPolicy), `maxRetry: 0` (Volcano) and `failurePolicy.maxRestarts: 0` (JobSet), so a failed
replica fails the attempt and the broker's restart budget decides what happens next.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any, NamedTuple

import msgspec

from agents.kube.config import FlavorConfig
from schemas.agent import Dispatch
from schemas.job import PodSet

LABEL_JOB = "muster.dev/job-id"
LABEL_ATTEMPT = "muster.dev/attempt"
LABEL_PODSET = "muster.dev/podset"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_TOP = "muster.dev/top-level"  # only on the objects Muster creates, not on their pods
MANAGED_BY = "muster"
ANN_JOB = "muster.dev/job-id"
ANN_TOTAL = "muster.dev/total-replicas"
ANN_KIND = "muster.dev/workload-kind"
ANN_LEADER = "muster.dev/leader"
ANN_ORIGINAL_NAME = "muster.dev/original-name"
ANN_CHECKPOINT = "muster.dev/checkpoint"
ANN_CHECKPOINT_REQUEST = "muster.dev/checkpoint-request"
COMPLETION_INDEX_ANN = "batch.kubernetes.io/job-completion-index"
HOSTNAME_KEY = "kubernetes.io/hostname"
PODINFO_VOLUME = "muster-podinfo"
PODINFO_DIR = "/etc/muster/podinfo"

_NAME_RE = re.compile(r"[^a-z0-9-]+")
_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


class ManifestError(ValueError):
    """The dispatch cannot become Kubernetes objects; the text says why."""


class Resource(NamedTuple):
    """Where a kind lives in the API: group/version, plural and the REST collection path."""

    api_version: str
    kind: str
    plural: str

    def collection(self, namespace: str) -> str:
        if "/" in self.api_version:
            return f"/apis/{self.api_version}/namespaces/{namespace}/{self.plural}"
        return f"/api/{self.api_version}/namespaces/{namespace}/{self.plural}"

    def item(self, namespace: str, name: str) -> str:
        return f"{self.collection(namespace)}/{name}"


SERVICE = Resource("v1", "Service", "services")
BATCH_JOB = Resource("batch/v1", "Job", "jobs")
PYTORCHJOB = Resource("kubeflow.org/v1", "PyTorchJob", "pytorchjobs")
TFJOB = Resource("kubeflow.org/v1", "TFJob", "tfjobs")
MPIJOB = Resource("kubeflow.org/v2beta1", "MPIJob", "mpijobs")
VOLCANO_JOB = Resource("batch.volcano.sh/v1alpha1", "Job", "jobs")
JOBSET = Resource("jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets")
XGBOOSTJOB = Resource("kubeflow.org/v1", "XGBoostJob", "xgboostjobs")
PADDLEJOB = Resource("kubeflow.org/v1", "PaddleJob", "paddlejobs")
MXJOB = Resource("kubeflow.org/v1", "MXJob", "mxjobs")
POD = Resource("v1", "Pod", "pods")

# Every kind the backend may create (the kinds `broker.manifests` derives gangs from); the
# startup scan, cancel and the RBAC in deploy/ cover exactly these.
OWNED_RESOURCES: tuple[Resource, ...] = (
    SERVICE,
    BATCH_JOB,
    PYTORCHJOB,
    TFJOB,
    MPIJOB,
    XGBOOSTJOB,
    PADDLEJOB,
    MXJOB,
    VOLCANO_JOB,
    JOBSET,
    POD,
)

# (API group, kind) -> plural, for manifests in any served version of a supported kind.
_PLURALS: dict[tuple[str, str], str] = {
    ("batch", "Job"): "jobs",
    ("kubeflow.org", "PyTorchJob"): "pytorchjobs",
    ("kubeflow.org", "TFJob"): "tfjobs",
    ("kubeflow.org", "MPIJob"): "mpijobs",
    ("kubeflow.org", "XGBoostJob"): "xgboostjobs",
    ("kubeflow.org", "PaddleJob"): "paddlejobs",
    ("kubeflow.org", "MXJob"): "mxjobs",
    ("batch.volcano.sh", "Job"): "jobs",
    ("jobset.x-k8s.io", "JobSet"): "jobsets",
    ("", "Pod"): "pods",
}
_KUBEFLOW_SPECS = {
    "PyTorchJob": "pytorchReplicaSpecs",
    "TFJob": "tfReplicaSpecs",
    "MPIJob": "mpiReplicaSpecs",
    "XGBoostJob": "xgbReplicaSpecs",
    "PaddleJob": "paddleReplicaSpecs",
    "MXJob": "mxReplicaSpecs",
}
# Replica types whose success is the job's success (Kubeflow's default success policies).
_LEADER_TYPES = {"master", "launcher", "chief"}


def resource_for(api_version: str, kind: str) -> Resource:
    group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
    plural = _PLURALS.get((group, kind))
    if plural is None:
        supported = ", ".join(f"{k} ({g})" for g, k in _PLURALS)
        raise ManifestError(
            f"workload.manifest: unsupported kind {kind!r} of {api_version!r}; "
            f"supported: {supported}"
        )
    return Resource(api_version, kind, plural)


# -- names and labels -----------------------------------------------------------------------


def _hash(text: str, n: int = 6) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


def _slug(text: str) -> str:
    return _NAME_RE.sub("-", text.lower()).strip("-")


def workload_name(job_id: str, attempt: int) -> str:
    """A DNS-1035 name unique per (job_id, attempt), at most ~40 characters, readable when the
    id is already a clean DNS label."""
    slug = _slug(job_id)
    if slug != job_id or len(slug) > 28 or not slug[:1].isalpha():
        core = slug[:20].strip("-")
        slug = f"{core}-{_hash(job_id)}" if core else _hash(job_id)
        if not slug[0].isalpha():
            slug = "j" + slug
    return f"{slug}-a{attempt}"


def child_name(base: str, part: str, limit: int = 52) -> str:
    """`base-part` within `limit` (Indexed Job pods are named `<job>-<index>-<suffix>` and
    their hostname `<job>-<index>` must stay a 63-character label)."""
    name = f"{base}-{_slug(part)}".strip("-")
    if len(name) > limit:
        name = f"{name[: limit - 7].rstrip('-')}-{_hash(name)}"
    return name


def label_value(job_id: str) -> str:
    """A label-safe form of a job id (ids may end in '-' or '_', label values may not)."""
    if _LABEL_VALUE_RE.match(job_id):
        return job_id
    core = re.sub(r"[^A-Za-z0-9_.-]", "-", job_id).strip("-_.")[:50].strip("-_.")
    return f"{core}-{_hash(job_id)}" if core else _hash(job_id)


def muster_labels(job_id: str, attempt: int, podset: str | None = None) -> dict[str, str]:
    labels = {
        LABEL_JOB: label_value(job_id),
        LABEL_ATTEMPT: str(attempt),
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    if podset is not None:
        labels[LABEL_PODSET] = podset
    return labels


def selector(job_id: str | None = None, attempt: int | None = None) -> str:
    """labelSelector for the objects Muster created (not their pods): every job's, one
    job's, or one attempt's."""
    sel = (
        f"{LABEL_TOP},{LABEL_JOB}"
        if job_id is None
        else f"{LABEL_TOP},{LABEL_JOB}={label_value(job_id)}"
    )
    return sel if attempt is None else f"{sel},{LABEL_ATTEMPT}={attempt}"


# -- env and placement ----------------------------------------------------------------------


def muster_env(cmd: Dispatch) -> list[dict[str, Any]]:
    """The variables every container gets, whatever the workload kind."""
    uri = cmd.checkpoint_uri or (cmd.spec.checkpoint.uri if cmd.spec.checkpoint else "")
    resume = cmd.resume_from
    return [
        {"name": "MUSTER_JOB_ID", "value": cmd.job_id},
        {"name": "MUSTER_ATTEMPT", "value": str(cmd.attempt)},
        {"name": "MUSTER_CHECKPOINT_URI", "value": uri},
        {"name": "MUSTER_RESUME_FROM", "value": resume.uri if resume else ""},
        {"name": "MUSTER_RESUME_STEP", "value": str(resume.step) if resume else ""},
        {"name": "MUSTER_PODINFO_DIR", "value": PODINFO_DIR},
    ]


def _merge_env(container: dict[str, Any], env: list[dict[str, Any]]) -> None:
    names = {e["name"] for e in env}
    kept = [e for e in container.get("env") or [] if e.get("name") not in names]
    container["env"] = kept + copy.deepcopy(env)


def _add_podinfo(pod_spec: dict[str, Any]) -> None:
    """Mount the pod's own annotations (downward API) so a workload can see a checkpoint
    request without API access."""
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != PODINFO_VOLUME]
    volumes.append(
        {
            "name": PODINFO_VOLUME,
            "downwardAPI": {
                "items": [
                    {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                ]
            },
        }
    )
    pod_spec["volumes"] = volumes
    for c in pod_spec.get("containers") or []:
        mounts = [m for m in c.get("volumeMounts") or [] if m.get("name") != PODINFO_VOLUME]
        mounts.append({"name": PODINFO_VOLUME, "mountPath": PODINFO_DIR, "readOnly": True})
        c["volumeMounts"] = mounts


def place(
    pod_spec: dict[str, Any],
    flavor: FlavorConfig,
    nodes: list[str],
    pod_selector: dict[str, str] | None,
) -> None:
    """Pin a pod template to the flavor and to `nodes` (see the module docstring)."""
    if flavor.node_labels:
        pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), **flavor.node_labels}
    if flavor.tolerations:
        existing = list(pod_spec.get("tolerations") or [])
        for t in flavor.tolerations:
            tol = t.to_k8s()
            if tol not in existing:
                existing.append(tol)
        pod_spec["tolerations"] = existing
    if not nodes:
        return
    unique = sorted(set(nodes))
    affinity = pod_spec.setdefault("affinity", {}) or {}
    pod_spec["affinity"] = affinity
    node_aff = affinity.setdefault("nodeAffinity", {})
    required = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    field = {"key": "metadata.name", "operator": "In", "values": unique}
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        fields = [f for f in term.get("matchFields") or [] if f.get("key") != "metadata.name"]
        term["matchFields"] = [*fields, field]
    required["nodeSelectorTerms"] = terms
    if pod_selector is not None and len(unique) == len(nodes) and len(nodes) > 1:
        anti = affinity.setdefault("podAntiAffinity", {})
        req = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
        req.append(
            {"labelSelector": {"matchLabels": dict(pod_selector)}, "topologyKey": HOSTNAME_KEY}
        )


def _prepare_template(
    template: dict[str, Any],
    cmd: Dispatch,
    flavor: FlavorConfig,
    podset: str,
    nodes: list[str],
    total: int,
    leader: bool,
    spread: bool,
    extra_env: list[dict[str, Any]] | None = None,
) -> None:
    """Labels, annotations, env, podinfo volume and placement on one pod template."""
    meta = template.setdefault("metadata", {}) or {}
    template["metadata"] = meta
    labels = muster_labels(cmd.job_id, cmd.attempt, podset)
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        ANN_JOB: cmd.job_id,
        ANN_TOTAL: str(total),
        ANN_KIND: cmd.spec.workload.kind,
        ANN_LEADER: "true" if leader else "false",
    }
    spec = template.setdefault("spec", {}) or {}
    template["spec"] = spec
    env = muster_env(cmd) + (extra_env or [])
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            _merge_env(c, env)
    _add_podinfo(spec)
    sel = {
        LABEL_JOB: labels[LABEL_JOB],
        LABEL_ATTEMPT: labels[LABEL_ATTEMPT],
        LABEL_PODSET: podset,
    }
    place(spec, flavor, nodes, sel if spread else None)


# -- the plan -------------------------------------------------------------------------------


class PlannedObject(NamedTuple):
    resource: Resource
    body: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


class WorkloadPlan(msgspec.Struct):
    """What `dispatch` creates, in order (Services first, so DNS exists when pods start)."""

    name: str
    objects: list[PlannedObject]
    total_replicas: int
    podsets: list[str]


def _object_meta(cmd: Dispatch, name: str, namespace: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**muster_labels(cmd.job_id, cmd.attempt), LABEL_TOP: "true"},
        "annotations": {
            ANN_JOB: cmd.job_id,
            ANN_TOTAL: "0",  # filled in by build_workload
            ANN_KIND: cmd.spec.workload.kind,
        },
    }


def _assigned(cmd: Dispatch) -> dict[str, list[str]]:
    return {a.podset: list(a.nodes) for a in cmd.assignment}


def _resources(ps: PodSet, gpu_resource: str) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": str(ps.cpu), "memory": str(ps.memory)}
    limits: dict[str, Any] = {}
    if ps.gpu:
        requests[gpu_resource] = str(ps.gpu)
        limits[gpu_resource] = str(ps.gpu)
    out: dict[str, Any] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def _container(cmd: Dispatch, name: str, ps: PodSet, gpu_resource: str) -> dict[str, Any]:
    w = cmd.spec.workload
    if not w.image:
        raise ManifestError(f"workload.image: required for kind {w.kind!r}")
    c: dict[str, Any] = {
        "name": name,
        "image": w.image,
        "resources": _resources(ps, gpu_resource),
        "ports": [{"name": "rdzv", "containerPort": w.port}],
        "env": [{"name": k, "value": v} for k, v in sorted(w.env.items())],
    }
    if w.command:
        c["command"] = list(w.command)
    if w.args:
        c["args"] = list(w.args)
    return c


def _check_assignment(cmd: Dispatch) -> None:
    by_name = _assigned(cmd)
    for ps in cmd.spec.gang:
        nodes = by_name.get(ps.name)
        if nodes is not None and len(nodes) != ps.replicas:
            raise ManifestError(
                f"assignment: podset {ps.name!r} has {len(nodes)} nodes for {ps.replicas} replicas"
            )


def build_indexed_job(
    cmd: Dispatch, flavor: FlavorConfig, namespace: str, gpu_resource: str = "nvidia.com/gpu"
) -> WorkloadPlan:
    """One Indexed Job per podset plus one headless Service, with the Kubeflow-style env:
    WORLD_SIZE = replicas of the whole gang, RANK = podset offset + completion index,
    LOCAL_RANK = 0, MASTER_ADDR = the first podset's index-0 pod, MASTER_PORT = workload.port,
    and torchrun's PET_* equivalents.

    RANK of a podset after the first needs arithmetic Kubernetes env cannot do, so its
    command runs under `/bin/sh -c` which adds MUSTER_RANK_OFFSET to JOB_COMPLETION_INDEX;
    that needs `workload.command` (the image's entrypoint is unknown here)."""
    gang = cmd.spec.gang
    if not gang:
        raise ManifestError("gang: indexed-job needs at least one podset")
    _check_assignment(cmd)
    base = workload_name(cmd.job_id, cmd.attempt)
    total = cmd.spec.total_replicas
    port = cmd.spec.workload.port
    first_job = child_name(base, gang[0].name)
    master_addr = f"{first_job}-0.{base}"
    by_name = _assigned(cmd)
    objects: list[PlannedObject] = []
    svc_meta = _object_meta(cmd, base, namespace)
    objects.append(
        PlannedObject(
            SERVICE,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": svc_meta,
                "spec": {
                    "clusterIP": "None",
                    "publishNotReadyAddresses": True,
                    "selector": {
                        LABEL_JOB: label_value(cmd.job_id),
                        LABEL_ATTEMPT: str(cmd.attempt),
                    },
                    "ports": [{"name": "rdzv", "port": port, "targetPort": port}],
                },
            },
        )
    )
    offset = 0
    for ps in gang:
        name = child_name(base, ps.name)
        container = _container(cmd, "trainer", ps, gpu_resource)
        index_ref = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANN}']"}}
        env: list[dict[str, Any]] = [
            {"name": "WORLD_SIZE", "value": str(total)},
            {"name": "MASTER_ADDR", "value": master_addr},
            {"name": "MASTER_PORT", "value": str(port)},
            {"name": "LOCAL_RANK", "value": "0"},
            {"name": "PET_NNODES", "value": str(total)},
            {"name": "PET_NPROC_PER_NODE", "value": str(max(ps.gpu, 1))},
            {"name": "PET_MASTER_ADDR", "value": master_addr},
            {"name": "PET_MASTER_PORT", "value": str(port)},
            {"name": "MUSTER_RANK_OFFSET", "value": str(offset)},
        ]
        if offset == 0:
            env += [{"name": "RANK", "valueFrom": index_ref}]
            env += [{"name": "PET_NODE_RANK", "valueFrom": index_ref}]
        else:
            if not cmd.spec.workload.command:
                raise ManifestError(
                    f"workload.command: podset {ps.name!r} is not the first podset, so its "
                    "RANK is MUSTER_RANK_OFFSET + JOB_COMPLETION_INDEX, computed by a shell "
                    "wrapper around the command; give workload.command"
                )
            script = (
                "export RANK=$((MUSTER_RANK_OFFSET + JOB_COMPLETION_INDEX)); "
                'export PET_NODE_RANK=$RANK; exec "$@"'
            )
            container["command"] = ["/bin/sh", "-c", script, "muster-rank"]
            container["args"] = [*cmd.spec.workload.command, *cmd.spec.workload.args]
        container["env"] = container["env"] + env
        template: dict[str, Any] = {
            "spec": {
                "restartPolicy": "Never",
                "subdomain": base,
                "containers": [container],
            }
        }
        nodes = by_name.get(ps.name) or []
        _prepare_template(template, cmd, flavor, ps.name, nodes, total, False, spread=True)
        meta = _object_meta(cmd, name, namespace)
        meta["labels"][LABEL_PODSET] = ps.name
        objects.append(
            PlannedObject(
                BATCH_JOB,
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": meta,
                    "spec": {
                        "completionMode": "Indexed",
                        "completions": ps.replicas,
                        "parallelism": ps.replicas,
                        "backoffLimit": 0,
                        "template": template,
                    },
                },
            )
        )
        offset += ps.replicas
    return _finish(base, objects, total, [p.name for p in gang])


def build_pytorchjob(
    cmd: Dispatch, flavor: FlavorConfig, namespace: str, gpu_resource: str = "nvidia.com/gpu"
) -> WorkloadPlan:
    """A Kubeflow PyTorchJob: Master x1 + Worker xN. With one podset of R replicas, replica 0
    is the Master and R-1 are Workers; with two podsets, the first (1 replica) is the Master
    and the second the Workers. The Training Operator injects WORLD_SIZE/RANK/MASTER_ADDR."""
    gang = cmd.spec.gang
    _check_assignment(cmd)
    by_name = _assigned(cmd)
    if len(gang) == 1:
        ps = gang[0]
        nodes = by_name.get(ps.name) or []
        roles = [("Master", ps, 1, nodes[:1])]
        if ps.replicas > 1:
            roles.append(("Worker", ps, ps.replicas - 1, nodes[1:]))
    elif len(gang) == 2 and gang[0].replicas == 1:
        m, w = gang
        roles = [
            ("Master", m, 1, by_name.get(m.name) or []),
            ("Worker", w, w.replicas, by_name.get(w.name) or []),
        ]
    else:
        raise ManifestError(
            "gang: pytorchjob needs one podset (replica 0 becomes the Master) or two podsets "
            "(a 1-replica master, then the workers)"
        )
    base = workload_name(cmd.job_id, cmd.attempt)
    total = cmd.spec.total_replicas
    specs: dict[str, Any] = {}
    for role, ps, replicas, nodes in roles:
        template: dict[str, Any] = {
            "spec": {"containers": [_container(cmd, "pytorch", ps, gpu_resource)]}
        }
        _prepare_template(
            template, cmd, flavor, ps.name, nodes, total, role == "Master", spread=True
        )
        specs[role] = {"replicas": replicas, "restartPolicy": "Never", "template": template}
    body = {
        "apiVersion": PYTORCHJOB.api_version,
        "kind": "PyTorchJob",
        "metadata": _object_meta(cmd, base, namespace),
        "spec": {
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }
    return _finish(base, [PlannedObject(PYTORCHJOB, body)], total, [p.name for p in gang])


class _Template(NamedTuple):
    podset: str
    replicas: int
    template: dict[str, Any]
    leader: bool


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100_000:
        raise ManifestError(f"workload.manifest.{path}: must be an integer from 0 to 100000")
    return value


def podset_key(text: str) -> str:
    """The podset name Muster gives a replica type / task / replicated job: a DNS-1123 label,
    exactly as `broker.manifests` derives the gang (so assignments match by name)."""
    s = re.sub(r"-{2,}", "-", _NAME_RE.sub("-", text.lower())).strip("-")
    return s[:63].rstrip("-")


def _job_pods(job_spec: dict[str, Any], path: str) -> int:
    """Pods of a batch/v1 Job that run at once: min(parallelism, completions)."""
    parallelism = _int(job_spec.get("parallelism", 1), f"{path}.parallelism")
    completions = job_spec.get("completions")
    if completions is None:
        return parallelism
    return min(parallelism, _int(completions, f"{path}.completions"))


def manifest_templates(manifest: dict[str, Any]) -> list[_Template]:
    """The pod templates of a supported manifest, each with its podset name (the same names
    `broker.manifests` derives): the Kubeflow replica type lower-cased (master, worker,
    launcher, ps, chief), the Volcano task name (`default` for one unnamed task), the JobSet
    replicated-job name, `worker` for a batch/v1 Job, `pod` for a v1 Pod. Replica types with
    0 replicas are listed too (patched, but they need no node)."""
    kind = str(manifest.get("kind", ""))
    api_version = str(manifest.get("apiVersion", ""))
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        raise ManifestError("workload.manifest.spec: missing or not an object")
    out: list[_Template] = []
    if kind in _KUBEFLOW_SPECS and api_version.startswith("kubeflow.org/"):
        key = _KUBEFLOW_SPECS[kind]
        replica_specs = spec.get(key)
        if not isinstance(replica_specs, dict) or not replica_specs:
            raise ManifestError(f"workload.manifest.spec.{key}: missing or empty")
        for rtype, rs in replica_specs.items():
            if not isinstance(rs, dict) or not isinstance(rs.get("template"), dict):
                raise ManifestError(f"workload.manifest.spec.{key}.{rtype}.template: missing")
            name = podset_key(str(rtype))
            replicas = _int(rs.get("replicas", 1), f"spec.{key}.{rtype}.replicas")
            out.append(_Template(name, replicas, rs["template"], name in _LEADER_TYPES))
    elif kind == "Job" and api_version.startswith("batch.volcano.sh/"):
        tasks = spec.get("tasks")
        if not isinstance(tasks, list) or not tasks:
            raise ManifestError("workload.manifest.spec.tasks: missing or empty")
        for i, task in enumerate(tasks):
            if not isinstance(task, dict) or not isinstance(task.get("template"), dict):
                raise ManifestError(f"workload.manifest.spec.tasks[{i}].template: missing")
            raw_name = task.get("name") or ("default" if len(tasks) == 1 else f"task{i}")
            replicas = _int(task.get("replicas", 1), f"spec.tasks[{i}].replicas")
            out.append(_Template(podset_key(str(raw_name)), replicas, task["template"], False))
    elif kind == "JobSet":
        rjobs = spec.get("replicatedJobs")
        if not isinstance(rjobs, list) or not rjobs:
            raise ManifestError("workload.manifest.spec.replicatedJobs: missing or empty")
        for i, rj in enumerate(rjobs):
            jt = rj.get("template") if isinstance(rj, dict) else None
            jspec = jt.get("spec") if isinstance(jt, dict) else None
            if not isinstance(jspec, dict) or not isinstance(jspec.get("template"), dict):
                raise ManifestError(
                    f"workload.manifest.spec.replicatedJobs[{i}].template.spec.template: missing"
                )
            pods = _job_pods(jspec, f"spec.replicatedJobs[{i}].template.spec")
            count = _int(rj.get("replicas", 1), f"spec.replicatedJobs[{i}].replicas")
            name = podset_key(str(rj.get("name") or f"rjob{i}"))
            out.append(_Template(name, count * pods, jspec["template"], False))
    elif kind == "Job" and api_version == "batch/v1":
        if not isinstance(spec.get("template"), dict):
            raise ManifestError("workload.manifest.spec.template: missing")
        out.append(_Template("worker", _job_pods(spec, "spec"), spec["template"], False))
    elif kind == "Pod" and api_version == "v1":
        out.append(_Template("pod", 1, manifest, True))
    else:
        raise ManifestError(f"workload.manifest.kind: unsupported kind {api_version} {kind}")
    return out


def build_from_manifest(cmd: Dispatch, flavor: FlavorConfig, namespace: str) -> WorkloadPlan:
    """The user's manifest, patched: our name/namespace/labels, the flavor's placement, the
    assigned nodes, MUSTER_* env, and retries off. Everything else is kept as written."""
    raw = cmd.spec.workload.manifest
    if not isinstance(raw, dict):
        raise ManifestError("workload.manifest: required for kind 'manifest'")
    manifest = copy.deepcopy(raw)
    api_version = str(manifest.get("apiVersion", ""))
    kind = str(manifest.get("kind", ""))
    resource = resource_for(api_version, kind)
    templates = manifest_templates(manifest)
    total = sum(t.replicas for t in templates)
    _check_assignment(cmd)
    by_key = {podset_key(k): v for k, v in _assigned(cmd).items()}
    all_nodes = [n for a in cmd.assignment for n in a.nodes]
    single = len([t for t in templates if t.replicas]) == 1 and len(cmd.assignment) == 1
    for t in templates:
        nodes = by_key.get(t.podset)
        if nodes is None and single and t.replicas:
            nodes = cmd.assignment[0].nodes
        spread = nodes is not None and len(nodes) == t.replicas
        _prepare_template(
            t.template,
            cmd,
            flavor,
            t.podset,
            list(nodes) if nodes is not None else all_nodes,
            total,
            t.leader,
            spread=spread,
        )
    base = workload_name(cmd.job_id, cmd.attempt)
    raw_meta = manifest.get("metadata")
    old: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    meta = _object_meta(cmd, base, namespace)
    meta["labels"] = {**(old.get("labels") or {}), **meta["labels"]}
    meta["annotations"] = {**(old.get("annotations") or {}), **meta["annotations"]}
    if old.get("name"):
        meta["annotations"][ANN_ORIGINAL_NAME] = str(old["name"])
    manifest["metadata"] = meta
    manifest.pop("status", None)
    spec = manifest["spec"]
    if kind in _KUBEFLOW_SPECS:
        run_policy = spec.setdefault("runPolicy", {}) or {}
        spec["runPolicy"] = run_policy
        run_policy["backoffLimit"] = 0
    elif api_version.startswith("batch.volcano.sh/"):
        spec["maxRetry"] = 0
    elif kind == "JobSet":
        fp = spec.setdefault("failurePolicy", {}) or {}
        spec["failurePolicy"] = fp
        fp["maxRestarts"] = 0
    elif kind == "Job":
        spec["backoffLimit"] = 0
    return _finish(base, [PlannedObject(resource, manifest)], total, [t.podset for t in templates])


def _finish(
    base: str, objects: list[PlannedObject], total: int, podsets: list[str]
) -> WorkloadPlan:
    for obj in objects:
        obj.body["metadata"]["annotations"][ANN_TOTAL] = str(total)
    return WorkloadPlan(name=base, objects=objects, total_replicas=total, podsets=podsets)


def build_workload(
    cmd: Dispatch, flavor: FlavorConfig, namespace: str, gpu_resource: str = "nvidia.com/gpu"
) -> WorkloadPlan:
    """Dispatch → the objects to create, by `spec.workload.kind`."""
    kind = cmd.spec.workload.kind
    if kind == "indexed-job":
        return build_indexed_job(cmd, flavor, namespace, gpu_resource)
    if kind == "pytorchjob":
        return build_pytorchjob(cmd, flavor, namespace, gpu_resource)
    if kind == "manifest":
        return build_from_manifest(cmd, flavor, namespace)
    raise ManifestError(f"workload.kind: unsupported kind {kind!r}")
