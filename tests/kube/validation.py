"""What a real API server would refuse, checked offline, so tests catch a manifest it rejects.

Three layers, as the API server applies them:

* schema: core kinds against the Kubernetes OpenAPI schema of `KUBE_VERSION` (the
  `kubernetes-validate` package, strict: unknown fields are errors, as with
  `fieldValidation=Strict`); custom kinds against the `openAPIV3Schema` of the served version in
  the vendored CRDs (`kinds/crds/`), strict likewise (a real server prunes unknown fields, which
  silently drops what Muster meant to set);
* semantics the schema cannot express but `kube-apiserver`'s validation enforces, for the
  fields Muster writes: DNS-1123 names, qualified label keys and values, node selector
  requirements (a `matchFields` requirement takes exactly one value), pod affinity topology
  keys, tolerations, container and volume names, restart policies of Job pods, Indexed Job
  completions;
* immutability on update (`old` given): name, namespace, uid, a Job's selector, template,
  completion mode and completions (an Indexed Job's may follow its parallelism, KEP-3715), a
  Pod's spec (but the mutable fields), a Service's clusterIP.

CEL rules of CRDs (`x-kubernetes-validations`) are not evaluated.

`validate(obj, old=None)` returns the causes as text; `causes()` returns them structured and
`invalid_status()` builds the 422 `Status` body a real server answers with.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

KUBE_VERSION = "1.33"
CRD_DIR = Path(__file__).resolve().parents[2] / "kinds" / "crds"
# CRDs of cluster components the stand-in models (autoscalers: tests/kube/autoscaler.py),
# vendored unmodified; their provenance is in docs/kubernetes.md.
STAND_IN_CRD_DIR = Path(__file__).resolve().parent / "crds"

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[^=]+$")
_TOLERATION_EFFECTS = {"", "NoSchedule", "PreferNoSchedule", "NoExecute"}
_NODE_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"}
_LABEL_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist"}
# Kinds whose name the API server checks as a DNS-1035 label rather than a subdomain.
_DNS1035_KINDS = {("v1", "Service")}
_CORE_GROUPS = {"", "batch", "apps", "networking.k8s.io", "scheduling.k8s.io", "policy"}
_CORE_GROUPS |= {"rbac.authorization.k8s.io", "coordination.k8s.io"}


@dataclass(frozen=True)
class Cause:
    """One entry of `details.causes` in a 422 Status."""

    field: str
    reason: str  # FieldValueRequired, FieldValueInvalid, FieldValueNotSupported, ...
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def validate(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Every reason a real API server would refuse `obj` (created, or updated from `old`)."""
    return [str(c) for c in causes(obj, old)]


def causes(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[Cause]:
    out = list(_schema_causes(obj))
    out += _metadata_causes(obj)
    claims = {
        str((t.get("metadata") or {}).get("name"))
        for t in (obj.get("spec") or {}).get("volumeClaimTemplates") or []
    }
    for path, pod_spec in pod_specs(obj):
        out += _pod_spec_causes(pod_spec, path, _is_job_pod(obj, path), claims)
    out += _kind_causes(obj)
    if old is not None:
        out += _immutable_causes(old, obj)
    return out


def invalid_status(obj: dict[str, Any], found: list[Cause]) -> dict[str, Any]:
    """The body of the 422 a real server answers: kind Status, reason Invalid, the causes."""
    api_version = str(obj.get("apiVersion", ""))
    group = api_version.rpartition("/")[0]
    kind = str(obj.get("kind", ""))
    name = str((obj.get("metadata") or {}).get("name", ""))
    qualified = f"{kind}.{group}" if group else kind
    listed = ", ".join(f"{c.field}: {c.message}" for c in found)
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'{qualified} "{name}" is invalid: [{listed}]',
        "reason": "Invalid",
        "details": {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in found],
        },
        "code": 422,
    }


def rejection(obj: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The 422 Status for `obj`, or None when a real server would accept it."""
    found = causes(obj, old)
    return invalid_status(obj, found) if found else None


# -- schema -----------------------------------------------------------------------------------


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def _schema_causes(obj: dict[str, Any]) -> Iterator[Cause]:
    api_version = str(obj.get("apiVersion", ""))
    kind = str(obj.get("kind", ""))
    if _group(api_version) in _CORE_GROUPS:
        validator = _core_validator(api_version, kind)
    else:
        validator = _crd_validator(api_version, kind)
        meta = _core_validator("v1", "ObjectMeta", standalone=True)
        for err in meta.iter_errors(obj.get("metadata") or {}):
            yield _schema_cause(err, prefix="metadata")
    if validator is None:
        yield Cause(
            "kind", "FieldValueNotSupported", f"no kind {kind!r} is served in {api_version}"
        )
        return
    for err in validator.iter_errors(obj):
        yield _schema_cause(err)


def _schema_cause(err: jsonschema.ValidationError, prefix: str = "") -> Cause:
    parts = [prefix] if prefix else []
    for p in err.absolute_path:
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
        else:
            parts.append(str(p))
    field = ".".join(parts) or "<root>"
    if err.validator == "additionalProperties":
        return Cause(field, "FieldValueInvalid", f"unknown field: {err.message}")
    if err.validator == "required":
        return Cause(field, "FieldValueRequired", f"Required value: {err.message}")
    if err.validator == "enum":
        return Cause(field, "FieldValueNotSupported", f"Unsupported value: {err.message}")
    if err.validator == "type":
        return Cause(field, "FieldValueTypeInvalid", f"Invalid value: {err.message}")
    return Cause(field, "FieldValueInvalid", f"Invalid value: {err.message}")


@functools.cache
def _core_definitions() -> tuple[str, Resource[Any]]:
    root = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    versions = sorted(
        (p.name for p in root.iterdir() if p.name.endswith("-local-strict")),
        key=lambda n: tuple(int(x) for x in n[1:].split("-")[0].split(".")),
    )
    chosen = [
        v for v in versions if v.startswith(f"v{KUBE_VERSION}.")
    ]  # exactly the pinned version
    if not chosen:
        raise RuntimeError(
            f"kubernetes-validate ships no schema for Kubernetes {KUBE_VERSION}; installed: "
            f"{', '.join(versions)}"
        )
    directory = chosen[-1]
    text = (root / directory / "_definitions.json").read_text()
    return directory, Resource.from_contents(json.loads(text))


@functools.cache
def _core_validator(
    api_version: str, kind: str, standalone: bool = False
) -> jsonschema.Draft202012Validator | None:
    directory, definitions = _core_definitions()
    root = resources.files("kubernetes_validate") / "kubernetes-json-schema" / directory
    if standalone:
        name = f"{kind.lower()}-meta-v1.json"
    else:
        name = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        name = f"{kind.lower()}-{name}.json"
    path = root / name
    if not path.is_file():
        return None
    schema = json.loads(path.read_text())
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = definitions @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _load_yaml(path: Path) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(), Loader=loader)


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version of the vendored CRDs."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in [*sorted(CRD_DIR.glob("*.yaml")), *sorted(STAND_IN_CRD_DIR.glob("*.yaml"))]:
        crd = _load_yaml(path)
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served", True):
                api_version = f"{spec['group']}/{version['name']}"
                out[(api_version, spec["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return out


def _strict(schema: Any) -> Any:
    """OpenAPI v3 structural schema -> JSON Schema where unknown fields are errors."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("nullable"):
        declared = out.get("type")
        if isinstance(declared, str):
            out["type"] = [declared, "null"]
    return out


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    schema = crd_schemas().get((api_version, kind))
    if schema is None:
        return None
    strict = _strict(schema)
    # metadata is checked against ObjectMeta; the CRD declares it as a bare object
    strict.setdefault("properties", {})["metadata"] = {"type": "object"}
    return jsonschema.Draft202012Validator(strict)


# -- semantics --------------------------------------------------------------------------------


def _name_causes(value: Any, field: str, dns1035: bool = False) -> list[Cause]:
    if not isinstance(value, str) or not value:
        return [Cause(field, "FieldValueRequired", "Required value: name or generateName")]
    if dns1035:
        if len(value) > 63 or not _DNS1035_LABEL.match(value):
            return [
                Cause(
                    field,
                    "FieldValueInvalid",
                    f"Invalid value: {value!r}: a DNS-1035 label must consist of lower case "
                    "alphanumeric characters or '-', start with an alphabetic character, and "
                    "end with an alphanumeric character, at most 63 characters",
                )
            ]
        return []
    if len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
        return [
            Cause(
                field,
                "FieldValueInvalid",
                f"Invalid value: {value!r}: a lowercase RFC 1123 subdomain must consist of lower "
                "case alphanumeric characters, '-' or '.', and must start and end with an "
                "alphanumeric character",
            )
        ]
    return []


def _qualified_key_causes(key: Any, field: str) -> list[Cause]:
    if not isinstance(key, str) or not key:
        return [Cause(field, "FieldValueInvalid", "Invalid value: '': name part must be non-empty")]
    prefix, _, name = key.rpartition("/")
    bad = []
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        bad.append(f"prefix part {prefix!r} must be a DNS-1123 subdomain")
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        bad.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character, at most 63 characters"
        )
    return [Cause(field, "FieldValueInvalid", f"Invalid value: {key!r}: {b}") for b in bad]


def _label_value_causes(value: Any, field: str) -> list[Cause]:
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        return [
            Cause(
                field,
                "FieldValueInvalid",
                f"Invalid value: {value!r}: a valid label must be an empty string or consist of "
                "alphanumeric characters, '-', '_' or '.', and must start and end with an "
                "alphanumeric character, at most 63 characters",
            )
        ]
    return []


def _labels_causes(labels: Any, field: str) -> list[Cause]:
    out: list[Cause] = []
    for key, value in (labels or {}).items():
        out += _qualified_key_causes(key, f"{field}")
        out += _label_value_causes(value, f"{field}[{key}]")
    return out


def _annotations_causes(annotations: Any, field: str) -> list[Cause]:
    out: list[Cause] = []
    total = 0
    for key, value in (annotations or {}).items():
        out += _qualified_key_causes(key, field)
        total += len(str(key)) + len(str(value))
    if total > 256 * 1024:
        out.append(Cause(field, "FieldValueTooLong", "Too long: must have at most 262144 bytes"))
    return out


def _metadata_causes(obj: dict[str, Any]) -> list[Cause]:
    meta = obj.get("metadata") or {}
    api_version, kind = str(obj.get("apiVersion", "")), str(obj.get("kind", ""))
    out: list[Cause] = []
    name = meta.get("name")
    if name is None and meta.get("generateName"):
        pass  # the server generates a valid name from a valid prefix
    else:
        out += _name_causes(name, "metadata.name", (api_version, kind) in _DNS1035_KINDS)
    if kind == "Namespace" and isinstance(name, str) and not _DNS1123_LABEL.match(name):
        out.append(Cause("metadata.name", "FieldValueInvalid", "must be a DNS-1123 label"))
    namespace = meta.get("namespace")
    if namespace is not None and (
        not isinstance(namespace, str) or len(namespace) > 63 or not _DNS1123_LABEL.match(namespace)
    ):
        out.append(
            Cause("metadata.namespace", "FieldValueInvalid", f"Invalid value: {namespace!r}")
        )
    out += _labels_causes(meta.get("labels"), "metadata.labels")
    out += _annotations_causes(meta.get("annotations"), "metadata.annotations")
    refs = meta.get("ownerReferences") or []
    if sum(1 for ref in refs if ref.get("controller")) > 1:
        out.append(
            Cause(
                "metadata.ownerReferences",
                "FieldValueInvalid",
                "Only one reference can have Controller set to true",
            )
        )
    for i, ref in enumerate(refs):
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                out.append(
                    Cause(
                        f"metadata.ownerReferences[{i}].{key}",
                        "FieldValueRequired",
                        "Required value",
                    )
                )
    return out


def pod_specs(obj: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every PodSpec inside an object (a Pod's spec, a template's spec, in any custom kind)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("containers"), list):
            yield path, obj
            return
        for key, value in obj.items():
            if key in ("status", "metadata"):
                continue
            yield from pod_specs(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from pod_specs(value, f"{path}[{i}]")


def _is_job_pod(obj: dict[str, Any], path: str) -> bool:
    """A pod run by a batch/v1 Job (directly or inside a JobSet or TrainJob runtime)."""
    if obj.get("kind") == "Job" and obj.get("apiVersion") == "batch/v1":
        return True
    return obj.get("kind") == "JobSet"


def _requirement_causes(req: Any, field: str, node_field: bool) -> list[Cause]:
    out: list[Cause] = []
    op = req.get("operator")
    values = req.get("values") or []
    allowed = {"In", "NotIn"} if node_field else _NODE_OPERATORS
    if op not in allowed:
        out.append(
            Cause(
                f"{field}.operator",
                "FieldValueNotSupported",
                f"Unsupported value: {op!r}: supported values: {', '.join(sorted(allowed))}",
            )
        )
        return out
    if node_field:
        if req.get("key") != "metadata.name":
            out.append(
                Cause(
                    f"{field}.key",
                    "FieldValueInvalid",
                    f"Invalid value: {req.get('key')!r}: not a valid field selector key",
                )
            )
        if len(values) != 1:
            out.append(
                Cause(
                    f"{field}.values",
                    "FieldValueRequired",
                    "Required value: must be only one value when `operator` is 'In' or "
                    "'NotIn' for node field selector",
                )
            )
        return out
    out += _qualified_key_causes(req.get("key"), f"{field}.key")
    if op in ("In", "NotIn") and not values:
        out.append(
            Cause(
                f"{field}.values",
                "FieldValueRequired",
                "Required value: must be specified when `operator` is 'In' or 'NotIn'",
            )
        )
    if op in ("Exists", "DoesNotExist") and values:
        out.append(
            Cause(
                f"{field}.values",
                "FieldValueForbidden",
                "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
            )
        )
    if op in ("Gt", "Lt"):
        if len(values) != 1:
            out.append(
                Cause(
                    f"{field}.values",
                    "FieldValueRequired",
                    "Required value: must be specified single value when `operator` is 'Lt' "
                    "or 'Gt'",
                )
            )
        elif not re.fullmatch(r"-?\d+", str(values[0])):
            out.append(Cause(f"{field}.values[0]", "FieldValueInvalid", "must be an integer"))
    return out


def _node_selector_causes(selector: Any, field: str) -> list[Cause]:
    terms = (selector or {}).get("nodeSelectorTerms")
    if not terms:
        return [
            Cause(
                f"{field}.nodeSelectorTerms",
                "FieldValueRequired",
                "Required value: must have at least one node selector term",
            )
        ]
    out: list[Cause] = []
    for i, term in enumerate(terms):
        tf = f"{field}.nodeSelectorTerms[{i}]"
        for j, req in enumerate(term.get("matchExpressions") or []):
            out += _requirement_causes(req, f"{tf}.matchExpressions[{j}]", node_field=False)
        for j, req in enumerate(term.get("matchFields") or []):
            out += _requirement_causes(req, f"{tf}.matchFields[{j}]", node_field=True)
    return out


def _label_selector_causes(selector: Any, field: str) -> list[Cause]:
    out: list[Cause] = []
    if selector is None:
        return out
    for key, value in (selector.get("matchLabels") or {}).items():
        out += _qualified_key_causes(key, f"{field}.matchLabels")
        out += _label_value_causes(value, f"{field}.matchLabels")
    for j, req in enumerate(selector.get("matchExpressions") or []):
        rf = f"{field}.matchExpressions[{j}]"
        op = req.get("operator")
        if op not in _LABEL_OPERATORS:
            out.append(Cause(f"{rf}.operator", "FieldValueNotSupported", f"{op!r}"))
            continue
        out += _qualified_key_causes(req.get("key"), f"{rf}.key")
        values = req.get("values") or []
        if op in ("In", "NotIn") and not values:
            out.append(Cause(f"{rf}.values", "FieldValueRequired", "Required value"))
        if op in ("Exists", "DoesNotExist") and values:
            out.append(Cause(f"{rf}.values", "FieldValueForbidden", "Forbidden"))
    return out


def _affinity_term_causes(term: Any, field: str) -> list[Cause]:
    out: list[Cause] = []
    if not term.get("topologyKey"):
        out.append(
            Cause(
                f"{field}.topologyKey",
                "FieldValueRequired",
                "Required value: can not be empty",
            )
        )
    else:
        out += _qualified_key_causes(term["topologyKey"], f"{field}.topologyKey")
    out += _label_selector_causes(term.get("labelSelector"), f"{field}.labelSelector")
    return out


def _affinity_causes(affinity: Any, field: str) -> list[Cause]:
    out: list[Cause] = []
    node = (affinity or {}).get("nodeAffinity") or {}
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        out += _node_selector_causes(
            required, f"{field}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        )
    for i, pref in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        pf = f"{field}.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[{i}]"
        weight = pref.get("weight")
        if not isinstance(weight, int) or not 1 <= weight <= 100:
            out.append(Cause(f"{pf}.weight", "FieldValueInvalid", "must be in the range 1-100"))
        term = pref.get("preference") or {}
        for j, req in enumerate(term.get("matchExpressions") or []):
            out += _requirement_causes(req, f"{pf}.preference.matchExpressions[{j}]", False)
        for j, req in enumerate(term.get("matchFields") or []):
            out += _requirement_causes(req, f"{pf}.preference.matchFields[{j}]", True)
    for kind in ("podAffinity", "podAntiAffinity"):
        block = (affinity or {}).get(kind) or {}
        for i, term in enumerate(block.get("requiredDuringSchedulingIgnoredDuringExecution") or []):
            out += _affinity_term_causes(
                term, f"{field}.{kind}.requiredDuringSchedulingIgnoredDuringExecution[{i}]"
            )
        for i, pref in enumerate(
            block.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        ):
            out += _affinity_term_causes(
                pref.get("podAffinityTerm") or {},
                f"{field}.{kind}.preferredDuringSchedulingIgnoredDuringExecution[{i}]"
                ".podAffinityTerm",
            )
    return out


def _toleration_causes(tolerations: Any, field: str) -> list[Cause]:
    out: list[Cause] = []
    for i, tol in enumerate(tolerations or []):
        tf = f"{field}[{i}]"
        op = tol.get("operator") or "Equal"
        key = tol.get("key") or ""
        if key:
            out += _qualified_key_causes(key, f"{tf}.key")
        elif op != "Exists":
            out.append(
                Cause(
                    f"{tf}.operator",
                    "FieldValueInvalid",
                    f"Invalid value: {op!r}: operator must be Exists when `key` is empty, which "
                    'means "match all values and all keys"',
                )
            )
        if op not in ("Equal", "Exists"):
            out.append(Cause(f"{tf}.operator", "FieldValueNotSupported", f"{op!r}"))
        if op == "Exists" and tol.get("value"):
            out.append(
                Cause(
                    f"{tf}.operator",
                    "FieldValueInvalid",
                    "value must be empty when `operator` is 'Exists'",
                )
            )
        if op == "Equal" and tol.get("value"):
            out += _label_value_causes(tol["value"], f"{tf}.value")
        if (tol.get("effect") or "") not in _TOLERATION_EFFECTS:
            out.append(Cause(f"{tf}.effect", "FieldValueNotSupported", f"{tol.get('effect')!r}"))
        if tol.get("tolerationSeconds") is not None and tol.get("effect") != "NoExecute":
            out.append(
                Cause(
                    f"{tf}.effect",
                    "FieldValueInvalid",
                    "effect must be 'NoExecute' when `tolerationSeconds` is set",
                )
            )
    return out


def _pod_spec_causes(
    spec: dict[str, Any], path: str, job_pod: bool, claims: set[str]
) -> list[Cause]:
    out: list[Cause] = []
    names: set[str] = set()
    volumes = {v.get("name") for v in spec.get("volumes") or []} | claims
    seen_volumes: set[str] = set()
    for i, vol in enumerate(spec.get("volumes") or []):
        name = vol.get("name")
        if not isinstance(name, str) or not _DNS1123_LABEL.match(name) or len(name) > 63:
            out.append(Cause(f"{path}.volumes[{i}].name", "FieldValueInvalid", f"{name!r}"))
        if name in seen_volumes:
            out.append(Cause(f"{path}.volumes[{i}].name", "FieldValueDuplicate", f"{name!r}"))
        seen_volumes.add(name)
    if not spec.get("containers"):
        out.append(Cause(f"{path}.containers", "FieldValueRequired", "Required value"))
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            cf = f"{path}.{key}[{i}]"
            name = c.get("name")
            if not isinstance(name, str) or len(name) > 63 or not _DNS1123_LABEL.match(name):
                out.append(Cause(f"{cf}.name", "FieldValueInvalid", f"Invalid value: {name!r}"))
            elif name in names:
                out.append(Cause(f"{cf}.name", "FieldValueDuplicate", f"Duplicate value: {name!r}"))
            names.add(str(name))
            if not c.get("image") and key == "containers" and "runtimePatches" not in path:
                out.append(Cause(f"{cf}.image", "FieldValueRequired", "Required value"))
            env_names: set[str] = set()
            for j, env in enumerate(c.get("env") or []):
                ename = env.get("name")
                if not isinstance(ename, str) or not _ENV_NAME.match(ename):
                    out.append(Cause(f"{cf}.env[{j}].name", "FieldValueInvalid", f"{ename!r}"))
                if "value" in env and "valueFrom" in env and env["value"]:
                    out.append(
                        Cause(
                            f"{cf}.env[{j}].valueFrom",
                            "FieldValueInvalid",
                            "may not be specified when `value` is not empty",
                        )
                    )
                env_names.add(str(ename))
            mount_paths: set[str] = set()
            for j, mount in enumerate(c.get("volumeMounts") or []):
                if mount.get("name") not in volumes:
                    out.append(
                        Cause(
                            f"{cf}.volumeMounts[{j}].name",
                            "FieldValueNotFound",
                            f"Not found: {mount.get('name')!r}",
                        )
                    )
                if mount.get("mountPath") in mount_paths:
                    out.append(
                        Cause(
                            f"{cf}.volumeMounts[{j}].mountPath",
                            "FieldValueInvalid",
                            "must be unique",
                        )
                    )
                mount_paths.add(mount.get("mountPath"))
    policy = spec.get("restartPolicy")
    if job_pod and policy not in ("Never", "OnFailure"):
        out.append(
            Cause(
                f"{path}.restartPolicy",
                "FieldValueNotSupported",
                f'Unsupported value: {policy!r}: supported values: "OnFailure", "Never"',
            )
        )
    for key, value in (spec.get("nodeSelector") or {}).items():
        out += _qualified_key_causes(key, f"{path}.nodeSelector")
        out += _label_value_causes(value, f"{path}.nodeSelector")
    out += _affinity_causes(spec.get("affinity"), f"{path}.affinity")
    out += _toleration_causes(spec.get("tolerations"), f"{path}.tolerations")
    grace = spec.get("terminationGracePeriodSeconds")
    if isinstance(grace, int) and grace < 0:
        out.append(
            Cause(f"{path}.terminationGracePeriodSeconds", "FieldValueInvalid", "must be >= 0")
        )
    sa = spec.get("serviceAccountName")
    if sa:
        out += _name_causes(sa, f"{path}.serviceAccountName")
    sub = spec.get("subdomain")
    if sub and (len(sub) > 63 or not _DNS1123_LABEL.match(sub)):
        out.append(Cause(f"{path}.subdomain", "FieldValueInvalid", f"{sub!r}"))
    return out


def _kind_causes(obj: dict[str, Any]) -> list[Cause]:
    """Rules of particular core kinds the schema leaves to the server."""
    out: list[Cause] = []
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    spec = obj.get("spec") or {}
    if (api_version, kind) == ("batch/v1", "Job"):
        name = (obj.get("metadata") or {}).get("name") or ""
        if len(name) > 63:
            out.append(
                Cause(
                    "metadata.name",
                    "FieldValueInvalid",
                    "must be no more than 63 characters (it becomes the job-name label)",
                )
            )
        if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
            out.append(
                Cause(
                    "spec.completions",
                    "FieldValueRequired",
                    "Required value: when completion mode is Indexed",
                )
            )
        for key in ("parallelism", "completions", "backoffLimit", "ttlSecondsAfterFinished"):
            value = spec.get(key)
            if isinstance(value, int) and value < 0:
                out.append(Cause(f"spec.{key}", "FieldValueInvalid", "must be >= 0"))
    if (api_version, kind) == ("v1", "Service"):
        seen: set[str] = set()
        for i, port in enumerate(spec.get("ports") or []):
            pname = port.get("name") or ""
            if len(spec.get("ports") or []) > 1 and not pname:
                out.append(Cause(f"spec.ports[{i}].name", "FieldValueRequired", "Required value"))
            if pname in seen:
                out.append(Cause(f"spec.ports[{i}].name", "FieldValueDuplicate", f"{pname!r}"))
            seen.add(pname)
            if pname and (len(pname) > 15 or not _DNS1123_LABEL.match(pname)):
                out.append(Cause(f"spec.ports[{i}].name", "FieldValueInvalid", f"{pname!r}"))
    return out


# -- immutability -----------------------------------------------------------------------------

_POD_MUTABLE = {"activeDeadlineSeconds", "tolerations", "schedulingGates", "containers"}


def _completions_causes(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    """`validateCompletions` (kubernetes/kubernetes `pkg/apis/batch/validation/validation.go`,
    Apache-2.0) with elastic Indexed Jobs allowed (KEP-3715, ElasticIndexedJob, GA in 1.31):
    a Job's completions are immutable, except an Indexed Job's, which may change only to
    equal the new parallelism."""
    if old.get("completions") == new.get("completions"):
        return []
    if new.get("completionMode") != "Indexed":
        return [Cause("spec.completions", "FieldValueInvalid", "field is immutable")]
    completions = new.get("completions")
    if completions is not None and completions != new.get("parallelism"):
        return [
            Cause(
                "spec.completions",
                "FieldValueInvalid",
                f"Invalid value: {completions}: can only be modified in tandem with "
                "spec.parallelism",
            )
        ]
    return []


def _immutable_causes(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    out: list[Cause] = []
    om, nm = old.get("metadata") or {}, new.get("metadata") or {}
    for key in ("name", "namespace", "uid"):
        if key in om and key in nm and om[key] != nm[key]:
            out.append(Cause(f"metadata.{key}", "FieldValueInvalid", "field is immutable"))
    if old.get("kind") != new.get("kind") or old.get("apiVersion") != new.get("apiVersion"):
        out.append(Cause("kind", "FieldValueInvalid", "field is immutable"))
        return out
    api_version, kind = new.get("apiVersion"), new.get("kind")
    os_, ns = old.get("spec") or {}, new.get("spec") or {}
    if (api_version, kind) == ("batch/v1", "Job"):
        for key in ("selector", "completionMode", "podFailurePolicy"):
            if os_.get(key) != ns.get(key):
                out.append(Cause(f"spec.{key}", "FieldValueInvalid", "field is immutable"))
        if os_.get("template") != ns.get("template"):
            out.append(Cause("spec.template", "FieldValueInvalid", "field is immutable"))
        out += _completions_causes(os_, ns)
    elif (api_version, kind) == ("v1", "Pod"):
        for key in set(os_) | set(ns):
            if key not in _POD_MUTABLE and os_.get(key) != ns.get(key):
                out.append(
                    Cause(
                        "spec",
                        "FieldValueForbidden",
                        f"Forbidden: pod updates may not change fields other than "
                        f"`spec.containers[*].image`, `spec.activeDeadlineSeconds`, "
                        f"`spec.tolerations` (only additions) ({key} changed)",
                    )
                )
        old_ads, new_ads = os_.get("activeDeadlineSeconds"), ns.get("activeDeadlineSeconds")
        if isinstance(old_ads, int) and new_ads is None:
            out.append(
                Cause(
                    "spec.activeDeadlineSeconds",
                    "FieldValueInvalid",
                    "must not update from a positive integer to nil value",
                )
            )
        elif isinstance(old_ads, int) and isinstance(new_ads, int) and new_ads > old_ads:
            out.append(
                Cause(
                    "spec.activeDeadlineSeconds",
                    "FieldValueInvalid",
                    "must be less than or equal to previous value",
                )
            )
        old_tol = os_.get("tolerations") or []
        new_tol = ns.get("tolerations") or []
        if any(t not in new_tol for t in old_tol):
            out.append(Cause("spec.tolerations", "FieldValueForbidden", "only additions"))
        oc, nc = os_.get("containers") or [], ns.get("containers") or []
        strip = [{k: v for k, v in c.items() if k != "image"} for c in oc]
        if strip != [{k: v for k, v in c.items() if k != "image"} for c in nc]:
            out.append(Cause("spec.containers", "FieldValueForbidden", "only the image may change"))
    elif (
        (api_version, kind) == ("v1", "Service")
        and os_.get("clusterIP")
        and os_.get("clusterIP") != ns.get("clusterIP")
    ):
        out.append(Cause("spec.clusterIP", "FieldValueInvalid", "field is immutable"))
    return out
