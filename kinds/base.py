"""What every job-kind adapter shares: where a kind lives in the API, its pod templates, its
verdict, and the one label/annotation domain Muster uses.

Pure data and functions (no I/O), importable by the broker and the agent alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

# One domain for every label and annotation Muster writes or reads. `muster.io/` was the
# domain of the manifest annotations the broker read; it is still accepted on input.
DOMAIN = "muster.dev"
LEGACY_DOMAIN = "muster.io"

LABEL_JOB = f"{DOMAIN}/job-id"
LABEL_ATTEMPT = f"{DOMAIN}/attempt"
LABEL_PODSET = f"{DOMAIN}/podset"
LABEL_ROLE = f"{DOMAIN}/role"  # the template a pod came from (several roles may share a podset)
LABEL_SPREAD = f"{DOMAIN}/spread"  # pods that must land on distinct nodes share its value
LABEL_TOP = f"{DOMAIN}/top-level"  # only on the objects Muster creates, not on their pods
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "muster"
ANN_JOB = f"{DOMAIN}/job-id"
ANN_TOTAL = f"{DOMAIN}/total-replicas"
ANN_KIND = f"{DOMAIN}/workload-kind"
ANN_LEADER = f"{DOMAIN}/leader"
ANN_ORIGINAL_NAME = f"{DOMAIN}/original-name"
ANN_CHECKPOINT = f"{DOMAIN}/checkpoint"
# sha256 of the attempt's checkpoint token, on its pods: the report endpoint's check after
# an agent restart (agents/kube/report.py).
ANN_TOKEN_DIGEST = f"{DOMAIN}/checkpoint-token-sha256"
ANN_CHECKPOINT_REQUEST = f"{DOMAIN}/checkpoint-request"
HOSTNAME_KEY = "kubernetes.io/hostname"

_DNS_CHARS = re.compile(r"[^a-z0-9-]+")


class KindError(ValueError):
    """A manifest Muster cannot handle as its kind; the text names the field path and the fix."""


class ResizeRefused(KindError):
    """A running object of this kind cannot take a new replica count in place; the text says
    why (the kind has no such field, or its pod template cannot follow the new nodes)."""


def pinned_nodes(template: Mapping[str, Any]) -> set[str]:
    """The nodes a pod template's required node affinity admits by `metadata.name` (how
    kinds/pods.py pins a podset); empty when it pins none."""
    spec = template.get("spec") if isinstance(template.get("spec"), Mapping) else {}
    affinity = (spec or {}).get("affinity") or {}
    required = (affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    return {
        value
        for term in required.get("nodeSelectorTerms") or []
        for field in term.get("matchFields") or []
        if field.get("key") == "metadata.name"
        for value in field.get("values") or []
    }


def keep_pins(kind: str, path: str, live: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """For a kind whose pod templates cannot change once created: refuse a revision whose
    pods need nodes the live template does not admit (they could never be scheduled)."""
    before, after = pinned_nodes(live), pinned_nodes(new)
    if before and not after <= before:
        raise ResizeRefused(
            f"{kind} {path}: the pod template cannot change after creation, so its pods stay "
            f"pinned to the nodes it started on ({', '.join(sorted(before))}) and cannot use "
            f"{', '.join(sorted(after - before))}"
        )


class Resource(NamedTuple):
    """Where a kind lives in the API: group/version, kind, plural and the REST paths."""

    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def collection(self, namespace: str) -> str:
        if "/" in self.api_version:
            return f"/apis/{self.api_version}/namespaces/{namespace}/{self.plural}"
        return f"/api/{self.api_version}/namespaces/{namespace}/{self.plural}"

    def item(self, namespace: str, name: str) -> str:
        return f"{self.collection(namespace)}/{name}"


SERVICE = Resource("v1", "Service", "services")
POD = Resource("v1", "Pod", "pods")


class PodTemplate(NamedTuple):
    """One pod template of a manifest and the podset its pods belong to.

    `template` is the manifest's own dict (patching it patches the manifest). `role` names the
    template (a Kubeflow replica type, a Volcano task, ...); several roles may share a podset
    when Muster split one podset into a leader and the rest."""

    podset: str
    replicas: int
    template: dict[str, Any]
    leader: bool
    role: str
    path: str  # where the template sits in the manifest, for error messages


class Verdict(NamedTuple):
    """How a workload object ended, by its own status."""

    phase: str  # "succeeded" | "failed"
    reason: str


def podset_key(text: str) -> str:
    """The podset name of a replica type / task / replicated job: a DNS-1123 label, the same
    on the broker (deriving the gang) and the agent (pinning the templates)."""
    s = re.sub(r"-{2,}", "-", _DNS_CHARS.sub("-", text.lower())).strip("-")
    return s[:63].rstrip("-")


def mapping(value: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None:
        if required:
            raise KindError(f"{path}: missing; add it (see the kind's documentation)")
        return {}
    if not isinstance(value, Mapping):
        raise KindError(f"{path}: expected a mapping, got {type(value).__name__}")
    return value


def listed(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise KindError(f"{path}: expected a list, got {type(value).__name__}")
    return value


def count(value: Any, path: str, default: int) -> int:
    """A replica/parallelism count: a non-negative whole number."""
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value.strip())
    else:
        raise KindError(f"{path}: expected a whole number, got {value!r}")
    if n < 0:
        raise KindError(f"{path}: must not be negative, got {n}")
    return n


def template_at(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("spec"), dict):
        raise KindError(f"{path}: missing; give the pod template (`metadata` and `spec`)")
    return value


def podset_name(raw: Any, path: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise KindError(f"{path}: a name is required")
    name = podset_key(raw)
    if not name:
        raise KindError(f"{path}: {raw!r} has no letters or digits to name a podset with")
    return name


class ReplicaRow(NamedTuple):
    """One entry of a manifest's replica table (a JobSet replicatedJob, a Volcano task, a
    Kubeflow replica spec, a Ray worker group): where it is, its podset name, itself."""

    path: str
    name: str
    spec: Mapping[str, Any]

    def replicas(self, key: str = "replicas", default: int = 1) -> int:
        return count(self.spec.get(key), f"{self.path}.{key}", default)

    def template(self, key: str = "template") -> dict[str, Any]:
        return template_at(self.spec.get(key), f"{self.path}.{key}")


def replica_rows(
    table: list[Any] | Mapping[str, Any],
    path: str,
    *,
    name_key: str = "name",
    default_name: str | None = None,
) -> list[ReplicaRow]:
    """The entries of a replica table, each checked to be a mapping with a valid podset name:
    a list names each entry by its `name_key` (else `default_name`), a mapping by its key."""
    out: list[ReplicaRow] = []
    if isinstance(table, Mapping):
        for key, entry in table.items():
            at = f"{path}.{key}"
            out.append(ReplicaRow(at, podset_name(key, at), mapping(entry, at)))
        return out
    for i, entry in enumerate(table):
        at = f"{path}[{i}]"
        spec = mapping(entry, at)
        name = podset_name(spec.get(name_key) or default_name, f"{at}.{name_key}")
        out.append(ReplicaRow(at, name, spec))
    return out


def job_pods(job_spec: Mapping[str, Any], path: str) -> int:
    """Pods of a batch/v1 Job that run at once: min(parallelism, completions)."""
    parallelism = count(job_spec.get("parallelism"), f"{path}.parallelism", 1)
    completions = job_spec.get("completions")
    if completions is None:
        return parallelism
    return min(parallelism, count(completions, f"{path}.completions", 1))


def keep_ttl(parent: dict[str, Any], seconds: int) -> None:
    """`ttlSecondsAfterFinished` for the agent's clean-up, unless the author set one."""
    current = parent.get("ttlSecondsAfterFinished")
    if not (isinstance(current, int) and not isinstance(current, bool) and current >= 0):
        parent["ttlSecondsAfterFinished"] = seconds


def ensure(parent: dict[str, Any], key: str) -> dict[str, Any]:
    """`parent[key]` as a dict, created (or replaced when null) if needed."""
    value = parent.get(key)
    if not isinstance(value, dict):
        value = {}
        parent[key] = value
    return value


def condition_verdict(
    what: str,
    status: Mapping[str, Any],
    success: tuple[str, ...],
    failure: tuple[str, ...],
) -> Verdict | None:
    """The verdict of `status.conditions` (status "True"); the last terminal one listed wins,
    as operators append the newest."""
    found: Verdict | None = None
    for c in status.get("conditions") or ():
        if not isinstance(c, Mapping) or c.get("status") != "True":
            continue
        ctype = str(c.get("type", ""))
        if ctype in failure:
            found = Verdict(
                "failed", verdict_reason(what, ctype, c.get("reason"), c.get("message"))
            )
        elif ctype in success:
            found = Verdict(
                "succeeded", verdict_reason(what, ctype, c.get("reason"), c.get("message"))
            )
    return found


MAX_REASON = 1024  # schemas.agent.Reason


def clip(text: str, limit: int = MAX_REASON) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def verdict_reason(what: str, state: str, reason: Any, message: Any) -> str:
    text = f"{what}: {state}"
    if reason and reason != state:
        text += f" ({reason})"
    if message:
        text += f": {message}"
    return clip(text)


def rewrite_strings(
    template: Mapping[str, Any], pattern: re.Pattern[str], fix: Callable[[re.Match[str]], str]
) -> None:
    """Apply `pattern` -> `fix` to every container's env values, command and args (init
    containers too) of a pod template, in place."""
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or ():
            if not isinstance(c, dict):
                continue
            for env in c.get("env") or ():
                if isinstance(env, dict) and isinstance(env.get("value"), str):
                    env["value"] = pattern.sub(fix, env["value"])
            for field in ("command", "args"):
                words = c.get(field)
                if isinstance(words, list):
                    c[field] = [pattern.sub(fix, w) if isinstance(w, str) else w for w in words]


def rename_hosts(
    templates: Iterable[PodTemplate],
    old: str,
    new: str,
    groups: Iterable[str],
    indexes: int,
    subdomain: str | None,
) -> None:
    """Rewrite pod hostnames `<old>-<group>(-<index>){indexes}[.<subdomain>]` that an author
    hard-coded into `<new>-...`: the subdomain follows too when it defaulted to the object's
    name (`subdomain` None), and stays when the author set it."""
    names = "|".join(re.escape(g) for g in sorted(set(groups), key=len, reverse=True) if g)
    if not names or old == new:
        return
    numbers = r"-\d+" * indexes
    host = re.compile(
        rf"(?<![a-z0-9.-]){re.escape(old)}-(?:{names}){numbers}"
        rf"(\.{re.escape(subdomain or old)})?(?![a-z0-9-])"
    )

    def fix(m: re.Match[str]) -> str:
        text = m.group(0)
        domain = m.group(1)
        stem = text[len(old) : len(text) - len(domain or "")]
        if domain is not None and subdomain is None:
            domain = f".{new}"
        return f"{new}{stem}{domain or ''}"

    for t in templates:
        rewrite_strings(t.template, host, fix)


# Kueue's elastic jobs (workload slices, KEP-77): the job's size may change while it runs.
ELASTIC_JOB_ANN = "kueue.x-k8s.io/elastic-job"


def elastic_job(manifest: Mapping[str, Any]) -> bool:
    """Whether the manifest carries `kueue.x-k8s.io/elastic-job: "true"`."""
    meta = mapping(manifest.get("metadata"), "metadata")
    annotations = mapping(meta.get("annotations"), "metadata.annotations")
    return str(annotations.get(ELASTIC_JOB_ANN, "")).strip().lower() == "true"
