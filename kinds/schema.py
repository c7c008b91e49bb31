"""Strict field validation of a submitted manifest, as `kubectl apply --validate=strict` does.

A typo inside a manifest (`replica:` for `replicas:`, `limit:` for `limits:`) would otherwise be
dropped silently: the API server prunes unknown fields of a custom resource, so a PyTorchJob
Worker with `replica: 2` runs one worker, and a container with `limit:` asks for no GPU. The
broker refuses such a manifest at submission, naming the field path and the closest known field.

Schemas: a custom kind is checked against the `openAPIV3Schema` of its served version in the
vendored CRDs (`kinds/crds/*.yaml`); `v1 Pod` and `batch/v1 Job` (and `metadata` of every kind,
as `ObjectMeta`) against the Kubernetes OpenAPI schema vendored in `kinds/crds/core-v1.33.json`
(provenance in `kinds/crds/README.md`). Checked: unknown fields (strictly, but where the schema
says `x-kubernetes-preserve-unknown-fields`), value types (int-or-string and quantities
included), `required` and `enum`. A `null` is accepted anywhere, as the API server drops it.
Patterns, formats, bounds and CEL rules are left to the API server.

A field the vendored CRD does not know may be legitimate on a newer operator: the refusal says
which operator version Muster checks against, and the annotation
`muster.dev/field-validation: Warn` turns unknown-field refusals into warnings (wrong types are
refused still).
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from kinds.base import DOMAIN

CRD_DIR = Path(__file__).resolve().parent / "crds"
CORE_SCHEMA = CRD_DIR / "core-v1.33.json"
KUBE_VERSION = "1.33"
FIELD_VALIDATION = f"{DOMAIN}/field-validation"
# The definitions of the vendored core schema: what a Pod, a Job and ObjectMeta reach.
CORE_ROOTS = {
    ("v1", "Pod"): "io.k8s.api.core.v1.Pod",
    ("batch/v1", "Job"): "io.k8s.api.batch.v1.Job",
}
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# Operator release of each vendored CRD, for the note on an unknown field (kinds/crds/README.md).
OPERATORS = {
    "kubeflow.org/v1": "Kubeflow training-operator v1.9.0",
    "kubeflow.org/v2beta1": "mpi-operator v0.8.0",
    "jobset.x-k8s.io/v1alpha2": "JobSet v0.12.0",
    "batch.volcano.sh/v1alpha1": "Volcano v1.15.1",
    "ray.io/v1": "KubeRay v1.7.0",
    "trainer.kubeflow.org/v1alpha1": "Kubeflow Trainer v2.3.0",
}
MAX_PROBLEMS = 5  # listed in one refusal; the rest are counted

_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, Mapping),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


_WANTED = {
    "object": "a mapping",
    "array": "a list",
    "string": "a string",
    "integer": "a whole number",
    "number": "a number",
    "boolean": "true or false",
}


class Problem(NamedTuple):
    """One reason the API server would refuse a manifest: where, and what to do."""

    path: str
    message: str
    unknown: bool  # an unknown field (a warning under `field-validation: Warn`)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


# -- schemas ----------------------------------------------------------------------------------


def _load_yaml(path: Path) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)


@functools.cache
def _core() -> dict[str, Any]:
    defs: dict[str, Any] = json.loads(CORE_SCHEMA.read_text(encoding="utf-8"))["$defs"]
    return defs


@functools.cache
def _crd_file(path: Path) -> dict[tuple[str, str], Any]:
    crd = _load_yaml(path)
    spec = crd["spec"]
    return {
        (f"{spec['group']}/{v['name']}", spec["names"]["kind"]): v["schema"]["openAPIV3Schema"]
        for v in spec["versions"]
        if v.get("served", True)
    }


def crd_schema(api_version: str, kind: str, plural: str) -> Any | None:
    """The `openAPIV3Schema` a vendored CRD serves for (apiVersion, kind), or None. CRD files
    are named `<group>_<plural>[.<version>].yaml`; only the one asked for is parsed."""
    group, _, version = api_version.rpartition("/")
    for name in (f"{group}_{plural}.{version}.yaml", f"{group}_{plural}.yaml"):
        path = CRD_DIR / name
        if path.is_file():
            found = _crd_file(path).get((api_version, kind))
            if found is not None:
                return found
    return None


def core_subset(definitions: Mapping[str, Any]) -> dict[str, Any]:
    """The definitions the core roots and ObjectMeta reach, without descriptions: what
    `kinds/crds/core-v1.33.json` holds, cut from the Kubernetes OpenAPI definitions."""
    out: dict[str, Any] = {}
    todo = [*CORE_ROOTS.values(), OBJECT_META]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out[name] = _strip(definitions[name], todo)
    return {"$defs": dict(sorted(out.items()))}


def _strip(schema: Any, refs: list[str]) -> Any:
    if isinstance(schema, list):
        return [_strip(s, refs) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key == "$ref" and isinstance(value, str):
            refs.append(value.rpartition("/")[2])
        if key == "properties" and isinstance(value, Mapping):
            out[key] = {name: _strip(sub, refs) for name, sub in value.items()}
        else:
            out[key] = _strip(value, refs)
    return out


# -- the walk ---------------------------------------------------------------------------------


def _at(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    text = str(key)
    plain = text.replace("-", "").replace("_", "").isalnum()
    if plain:
        return f"{path}.{text}" if path else text
    return f"{path}[{text}]"


def _types(schema: Mapping[str, Any]) -> list[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    return []


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return _shown(value)


class _Walker:
    def __init__(self, defs: Mapping[str, Any]) -> None:
        self.defs = defs

    def resolve(self, schema: Any) -> Mapping[str, Any]:
        seen = 0
        while isinstance(schema, Mapping) and "$ref" in schema and seen < 16:
            schema = self.defs.get(str(schema["$ref"]).rpartition("/")[2], {})
            seen += 1
        return schema if isinstance(schema, Mapping) else {}

    def walk(self, value: Any, schema: Any, path: str) -> Iterator[Problem]:
        s = self.resolve(schema)
        if value is None or not s:
            return
        alternatives = s.get("anyOf") or s.get("oneOf")
        if s.get("x-kubernetes-int-or-string"):
            if not _TYPES["integer"](value) and not isinstance(value, str):
                yield Problem(
                    path, f"expected a whole number or a string, got {_type_name(value)}", False
                )
            return
        if isinstance(alternatives, list) and alternatives and not _types(s):
            branches = [list(self.walk(value, alt, path)) for alt in alternatives]
            if all(branches):
                yield min(branches, key=len)[0]
            return
        types = [t for t in _types(s) if t != "null"]
        if types and not any(_TYPES.get(t, lambda v: True)(value) for t in types):
            wanted = " or ".join(_WANTED.get(t, t) for t in types)
            yield Problem(path, f"expected {wanted}, got {_type_name(value)}", False)
            return
        enum = s.get("enum")
        if isinstance(enum, list) and enum and value not in enum:
            values = ", ".join(str(v) for v in enum if v is not None)
            yield Problem(
                path, f"unsupported value {_shown(value)}; supported values: {values}", False
            )
        if isinstance(value, Mapping):
            yield from self.mapping(value, s, path)
        elif isinstance(value, list):
            items = s.get("items")
            if items is not None:
                for i, item in enumerate(value):
                    yield from self.walk(item, items, _at(path, i))

    def mapping(
        self, value: Mapping[str, Any], s: Mapping[str, Any], path: str
    ) -> Iterator[Problem]:
        props = s.get("properties")
        props = props if isinstance(props, Mapping) else {}
        extra = s.get("additionalProperties")
        open_ = bool(s.get("x-kubernetes-preserve-unknown-fields")) or extra is True
        for name in s.get("required") or ():
            if value.get(name) is None:
                yield Problem(_at(path, name), "missing; add it (a required field)", False)
        for key, item in value.items():
            if key in props:
                yield from self.walk(item, props[key], _at(path, key))
            elif isinstance(extra, Mapping):
                if item is None:  # a null field is dropped; a null entry of a map is not
                    yield Problem(_at(path, key), "a value is required, got null", False)
                yield from self.walk(item, extra, _at(path, key))
            elif props and not open_:
                close = difflib.get_close_matches(str(key), list(props), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                known = ", ".join(sorted(props))
                yield Problem(_at(path, key), f"unknown field; {hint}known fields: {known}", True)


def problems(manifest: Mapping[str, Any], plural: str) -> list[Problem]:
    """Every field problem of `manifest` (a kind Muster runs; `plural` names its CRD file).
    Kinds with no vendored schema (a pod group's `v1 List`) are checked item by item."""
    api_version = str(manifest.get("apiVersion", ""))
    kind = str(manifest.get("kind", ""))
    core = _core()
    walker = _Walker(core)
    if (api_version, kind) == ("v1", "List"):
        out: list[Problem] = []
        for i, item in enumerate(manifest.get("items") or ()):
            if isinstance(item, Mapping):
                at = f"items[{i}]"
                out += [
                    p._replace(path=f"{at}.{p.path}" if p.path else at)
                    for p in problems(item, "pods")
                ]
        return out
    root = CORE_ROOTS.get((api_version, kind))
    if root is not None:
        return list(walker.walk(manifest, core[root], ""))
    schema = crd_schema(api_version, kind, plural)
    if schema is None:
        return []
    found = list(walker.walk(manifest.get("metadata"), core[OBJECT_META], "metadata"))
    body = {k: v for k, v in manifest.items() if k != "metadata"}
    found += walker.walk(body, schema, "")
    return found


def checked_against(api_version: str, kind: str) -> str:
    """What the fields were checked against, for the refusal."""
    if (api_version, kind) in CORE_ROOTS or (api_version, kind) == ("v1", "List"):
        return f"the Kubernetes {KUBE_VERSION} API"
    operator = OPERATORS.get(api_version)
    crd = f"the {api_version} {kind} CRD"
    return f"{crd} of {operator}" if operator else crd


def check(manifest: Mapping[str, Any], plural: str) -> tuple[str | None, list[Problem]]:
    """(the refusal text or None, the unknown fields let through under
    `field-validation: Warn`)."""
    found = problems(manifest, plural)
    if not found:
        return None, []
    metadata = manifest.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    mode = annotations.get(FIELD_VALIDATION) if isinstance(annotations, Mapping) else None
    warned: list[Problem] = []
    if isinstance(mode, str) and mode.strip().lower() == "warn":
        warned = [p for p in found if p.unknown]
        found = [p for p in found if not p.unknown]
        if not found:
            return None, warned
    listed = "; ".join(str(p) for p in found[:MAX_PROBLEMS])
    more = len(found) - MAX_PROBLEMS
    if more > 0:
        listed += f"; and {more} more"
    api_version = str(manifest.get("apiVersion", ""))
    text = (
        f"{listed} (fields checked strictly, as `kubectl apply --validate=strict` does, against "
        f"{checked_against(api_version, str(manifest.get('kind', '')))})"
    )
    if any(p.unknown for p in found) and api_version in OPERATORS:
        text += (
            f". If your operator is newer and serves such a field, annotate the manifest "
            f"`{FIELD_VALIDATION}: Warn` to submit it anyway"
        )
    return text, warned
