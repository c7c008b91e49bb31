"""What Muster writes into every pod template, whatever the kind.

Pinning (how the broker's node assignment is honoured)
-------------------------------------------------------
A kind has one pod template per replica type / task / replicated job, so a node cannot be
named per pod. Every template of a podset is pinned to the set of nodes assigned to that
podset with one required nodeSelectorTerm per node, `matchFields: metadata.name In [<node>]`
(the API server allows exactly one value in a node field requirement; terms are ORed). Terms
the user wrote are kept: each user term is combined with each node term, so both hold.

Spread (`pin_podsets`): podsets whose pods ask for the same resources form one class, pinned
to the union of the class's nodes; their pods are interchangeable. When no node holds two pods
of a class, a required `podAntiAffinity` on `kubernetes.io/hostname` against pods of the same
job, attempt and class (`muster.dev/spread`) puts exactly one pod on each node: the placement
is exact. When a node holds several, no anti-affinity is set, and any order of binding the
class's pods fits (a node assigned `a` of them has room for at least `a`, and there are as many
pods as slots the broker counted) -- unless a node of the class also hosts another class,
whose room the first could take. That case is not `exact`: Muster's own Indexed Job then
writes one Job per node for the podset; a user's template cannot be split (docs/kinds.md).

Protection, grace and tolerations
---------------------------------
Pods carry `karpenter.sh/do-not-disrupt: "true"` and
`cluster-autoscaler.kubernetes.io/safe-to-evict: "false"` (consolidation must not evict a
running gang), the flavor's tolerations (e.g. AKS `kubernetes.azure.com/scalesetpriority=spot`
or a GPU taint) and `terminationGracePeriodSeconds` of the flavor (the provider's notice window,
so the workload can checkpoint). `kueue.x-k8s.io/*` labels are removed, so a Kueue in the same
cluster does not suspend what Muster placed.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from kinds.base import (
    ANN_JOB,
    ANN_KIND,
    ANN_LEADER,
    ANN_TOKEN_DIGEST,
    ANN_TOTAL,
    HOSTNAME_KEY,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_PODSET,
    LABEL_ROLE,
    LABEL_SPREAD,
    LABEL_TOP,
    MANAGED_BY,
    KindError,
    ensure,
)
from schemas.agent import Dispatch

PODINFO_VOLUME = "muster-podinfo"
PODINFO_DIR = "/etc/muster/podinfo"
KUEUE_PREFIX = "kueue.x-k8s.io/"
DO_NOT_DISRUPT = {
    "karpenter.sh/do-not-disrupt": "true",
    "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
}
_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


class PodPolicy(NamedTuple):
    """What the flavor and the agent's configuration add to every pod template."""

    node_labels: Mapping[str, str] = {}
    tolerations: Sequence[Mapping[str, Any]] = ()
    grace_seconds: int | None = None  # terminationGracePeriodSeconds (the notice window)
    # The most graceful shutdown the provider gives whatever the pod asks (GKE spot: 15 s);
    # None = the pod's terminationGracePeriodSeconds holds.
    grace_cap_s: int | None = None
    # priorityClassName from the job's priority (a class the author named is kept)
    priority_class: str | None = None
    ttl_seconds: int | None = None  # ttlSecondsAfterFinished where the kind has one
    # allowed serviceAccountNames; None: not checked here (the broker, which has no list)
    service_accounts: frozenset[str] | None = frozenset({"default"})
    # The agent's checkpoint report endpoint (MUSTER_REPORT_URL); None: not offered.
    report_url: str | None = None
    # Added to every pod (the ProvisioningRequest a gang consumes, agents/kube/pools.py).
    annotations: Mapping[str, str] = {}


def _hash(text: str, n: int = 6) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


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


def strip_kueue(meta: dict[str, Any]) -> None:
    """Drop `kueue.x-k8s.io/*` labels, so Kueue does not manage (suspend) the object."""
    labels = meta.get("labels")
    if isinstance(labels, dict):
        meta["labels"] = {k: v for k, v in labels.items() if not k.startswith(KUEUE_PREFIX)}


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
    ] + (
        [{"name": "MUSTER_CHECKPOINT_TOKEN", "value": cmd.checkpoint_token}]
        if cmd.checkpoint_token
        else []
    )


REPORT_URL_ENV = "MUSTER_REPORT_URL"


def token_digest(token: str) -> str:
    """What the pods' annotation keeps of a checkpoint token: enough for an agent that
    restarted to check a report again, nothing a reader of the pod could report with."""
    return hashlib.sha256(token.encode()).hexdigest()


def report_env(cmd: Dispatch, policy: PodPolicy) -> list[dict[str, Any]]:
    """Where the SDK posts checkpoint reports: only with a token to post them with."""
    if not policy.report_url or not cmd.checkpoint_token:
        return []
    return [{"name": REPORT_URL_ENV, "value": policy.report_url}]


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


def node_terms(user_terms: list[dict[str, Any]], nodes: Sequence[str]) -> list[dict[str, Any]]:
    """Required nodeSelectorTerms that admit exactly `nodes` and still honour the user's own
    terms: every user term AND one node, for each pair (one value per field requirement)."""
    base = user_terms or [{}]
    out: list[dict[str, Any]] = []
    for node in sorted(set(nodes)):
        pin = {"key": "metadata.name", "operator": "In", "values": [node]}
        for term in base:
            fields = [f for f in term.get("matchFields") or [] if f.get("key") != "metadata.name"]
            combined = {k: copy.deepcopy(v) for k, v in term.items() if k != "matchFields"}
            combined["matchFields"] = [*copy.deepcopy(fields), pin]
            out.append(combined)
    return out


class Pin(NamedTuple):
    """Where a podset's templates are pinned: the node set, the spread class for the
    anti-affinity (None: none), and whether this reproduces the broker's placement exactly."""

    nodes: tuple[str, ...]
    spread: str | None
    exact: bool


def pin_podsets(
    assignment: Mapping[str, Sequence[str]], shapes: Mapping[str, Hashable]
) -> dict[str, Pin]:
    """The Pin of every assigned podset (see the module docstring). `shapes` maps a podset to
    what its pods ask for; podsets of equal shape share a class."""
    classes: dict[Hashable, list[str]] = {}
    for podset in assignment:
        classes.setdefault(shapes.get(podset, podset), []).append(podset)
    union: dict[Hashable, list[str]] = {
        shape: [n for p in members for n in assignment[p]] for shape, members in classes.items()
    }
    out: dict[str, Pin] = {}
    for shape, members in classes.items():
        nodes = union[shape]
        unique = tuple(sorted(set(nodes)))
        distinct = len(unique) == len(nodes)
        shared = any(set(unique) & set(other) for s2, other in union.items() if s2 != shape)
        spread = members[0] if distinct and len(nodes) > 1 else None
        for podset in members:
            out[podset] = Pin(unique, spread, distinct or not shared)
    return out


def place(
    pod_spec: dict[str, Any],
    policy: PodPolicy,
    nodes: Sequence[str],
    pod_selector: Mapping[str, str] | None,
) -> None:
    """Pin a pod spec to the flavor and to `nodes` (see the module docstring)."""
    if policy.node_labels:
        pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), **policy.node_labels}
    if policy.tolerations:
        existing = list(pod_spec.get("tolerations") or [])
        for tol in policy.tolerations:
            if dict(tol) not in existing:
                existing.append(dict(tol))
        pod_spec["tolerations"] = existing
    if not nodes:
        return
    affinity = ensure(pod_spec, "affinity")
    node_aff = ensure(affinity, "nodeAffinity")
    required = ensure(node_aff, "requiredDuringSchedulingIgnoredDuringExecution")
    required["nodeSelectorTerms"] = node_terms(list(required.get("nodeSelectorTerms") or []), nodes)
    if pod_selector is not None:
        anti = ensure(affinity, "podAntiAffinity")
        terms = list(anti.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        terms.append(
            {"labelSelector": {"matchLabels": dict(pod_selector)}, "topologyKey": HOSTNAME_KEY}
        )
        anti["requiredDuringSchedulingIgnoredDuringExecution"] = terms


SIGTERM_GRACE_ENV = "MUSTER_SIGTERM_GRACE_S"
DEFAULT_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it names none


def sigterm_grace_s(pod_spec: Mapping[str, Any], policy: PodPolicy) -> int:
    """The seconds between SIGTERM and SIGKILL this pod really gets: its
    terminationGracePeriodSeconds, cut to what the provider allows (GKE spot: 15 s)."""
    grace = pod_spec.get("terminationGracePeriodSeconds")
    seconds = grace if isinstance(grace, int) else DEFAULT_GRACE_S
    return seconds if policy.grace_cap_s is None else min(seconds, policy.grace_cap_s)


def prepare_template(
    template: dict[str, Any],
    cmd: Dispatch,
    policy: PodPolicy,
    podset: str,
    role: str,
    pin: Pin,
    total: int,
    leader: bool,
    extra_env: list[dict[str, Any]] | None = None,
) -> None:
    """Labels, annotations, env, podinfo volume, grace, tolerations and placement on one pod
    template."""
    meta = ensure(template, "metadata")
    strip_kueue(meta)
    labels = {**muster_labels(cmd.job_id, cmd.attempt, podset), LABEL_ROLE: role}
    if pin.spread is not None:
        labels[LABEL_SPREAD] = pin.spread
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        **DO_NOT_DISRUPT,
        **policy.annotations,
        ANN_JOB: cmd.job_id,
        ANN_TOTAL: str(total),
        ANN_KIND: cmd.spec.workload.kind,
        ANN_LEADER: "true" if leader else "false",
    }
    reporting = report_env(cmd, policy)
    meta["annotations"].pop(ANN_TOKEN_DIGEST, None)  # only the agent's own value counts
    if reporting:
        meta["annotations"][ANN_TOKEN_DIGEST] = token_digest(cmd.checkpoint_token)
    spec = ensure(template, "spec")
    env = muster_env(cmd) + reporting + (extra_env or [])
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            _merge_env(c, env)
    _add_podinfo(spec)
    if policy.grace_seconds is not None:
        current = spec.get("terminationGracePeriodSeconds")
        if not isinstance(current, int) or current < policy.grace_seconds:
            spec["terminationGracePeriodSeconds"] = policy.grace_seconds
    if policy.priority_class is not None and not spec.get("priorityClassName"):
        spec["priorityClassName"] = policy.priority_class
    grace_env = [{"name": SIGTERM_GRACE_ENV, "value": str(sigterm_grace_s(spec, policy))}]
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            _merge_env(c, grace_env)
    sel = None
    if pin.spread is not None:
        sel = {
            LABEL_JOB: labels[LABEL_JOB],
            LABEL_ATTEMPT: labels[LABEL_ATTEMPT],
            LABEL_SPREAD: pin.spread,
        }
    place(spec, policy, pin.nodes, sel)


# -- workload safety ------------------------------------------------------------------------


def _pod_specs(obj: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(obj, dict):
        if isinstance(obj.get("containers"), list):
            yield path, obj
            return
        for key, value in obj.items():
            if key not in ("status", "metadata"):
                yield from _pod_specs(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _pod_specs(value, f"{path}[{i}]")


# Capabilities a container may add: the Pod Security Standards' baseline list
# (kubernetes/website content/en/docs/concepts/security/pod-security-standards.md, CC BY 4.0)
# and IPC_LOCK, which EFA and RDMA/InfiniBand need to pin memory for the NIC. IPC_LOCK passes
# Pod Security Admission only in a namespace at the `privileged` level (the fabric namespace,
# deploy/agent/optional/fabric-namespace.yaml; the trade-off is in docs/security.md).
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
FABRIC_CAPABILITIES = frozenset({"IPC_LOCK"})
ADDABLE = BASELINE_CAPABILITIES | FABRIC_CAPABILITIES


def _added_capabilities(ctx: Mapping[str, Any]) -> list[str]:
    caps = ctx.get("capabilities")
    added = caps.get("add") if isinstance(caps, dict) else None
    return [str(c) for c in added] if isinstance(added, list) else []


def safety_problems(manifest: Mapping[str, Any], policy: PodPolicy) -> list[str]:
    """What the manifest asks for that Muster refuses by default: privileged containers,
    capabilities beyond the baseline ones and IPC_LOCK, hostPath volumes, the host's network
    or PID namespace, or a service account outside the agent's allow-list."""
    out: list[str] = []
    for path, spec in _pod_specs(manifest.get("spec"), "spec"):
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(flag) is True:
                out.append(f"{path}.{flag}: the host's namespaces are not allowed; remove it")
        sa = spec.get("serviceAccountName") or spec.get("serviceAccount")
        if sa and policy.service_accounts is not None and sa not in policy.service_accounts:
            allowed = ", ".join(sorted(policy.service_accounts)) or "none"
            out.append(
                f"{path}.serviceAccountName: {sa!r} is not in the agent's allowed service "
                f"accounts ({allowed}); remove it or ask the cluster admin to allow it"
            )
        for i, vol in enumerate(spec.get("volumes") or []):
            if isinstance(vol, dict) and "hostPath" in vol:
                out.append(
                    f"{path}.volumes[{i}].hostPath: host directories are not allowed; use a "
                    "persistentVolumeClaim or emptyDir"
                )
        for key in ("initContainers", "containers", "ephemeralContainers"):
            for i, c in enumerate(spec.get(key) or []):
                ctx = c.get("securityContext") if isinstance(c, dict) else None
                if not isinstance(ctx, dict):
                    continue
                if ctx.get("privileged") is True:
                    out.append(
                        f"{path}.{key}[{i}].securityContext.privileged: privileged containers "
                        "are not allowed; remove it"
                    )
                extra = [
                    c for c in _added_capabilities(ctx) if c.removeprefix("CAP_") not in ADDABLE
                ]
                if extra:
                    out.append(
                        f"{path}.{key}[{i}].securityContext.capabilities.add: {', '.join(extra)} "
                        "not allowed; a container may add the Pod Security baseline "
                        "capabilities and IPC_LOCK (for EFA and RDMA) only"
                    )
    return out


def check_safety(manifest: Mapping[str, Any], policy: PodPolicy) -> None:
    problems = safety_problems(manifest, policy)
    if problems:
        raise KindError("refused by the workload safety policy: " + "; ".join(problems))


def selector(job_id: str | None = None, attempt: int | None = None) -> str:
    """labelSelector for the objects Muster created (not their pods): every job's, one
    job's, or one attempt's."""
    sel = (
        f"{LABEL_TOP},{LABEL_JOB}"
        if job_id is None
        else f"{LABEL_TOP},{LABEL_JOB}={label_value(job_id)}"
    )
    return sel if attempt is None else f"{sel},{LABEL_ATTEMPT}={attempt}"
