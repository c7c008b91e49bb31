"""RBAC authorization for the API server stand-in: the shipped Roles, ClusterRoles and their
bindings decide every request, by the service account its bearer token stands for.

Modelled on Kubernetes (kubernetes/kubernetes, Apache-2.0):
* request attributes (verb from method + name + `watch`, resource/subresource, API group,
  namespace, name) as `k8s.io/apiserver/pkg/endpoints/request/requestinfo.go` derives them;
* rule matching as `plugin/pkg/auth/authorizer/rbac/rbac.go` does it (`*` wildcards,
  `resource/subresource` matched as one string, `resourceNames` only for requests that name an
  object); a RoleBinding grants in its own namespace, a ClusterRoleBinding everywhere;
* the refusal: `apierrors.NewForbidden(resource.group, name, forbiddenMessage)`, as in
  `k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go`;
* the OwnerReferencesPermissionEnforcement admission plugin
  (`plugin/pkg/admission/gc/gc_admission.go`): setting `blockOwnerDeletion: true` needs
  `update` on the owner's `finalizers` subresource.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kinds.registry import known_kinds
from tests.support import DEPLOY

DEPLOY_AGENT = DEPLOY / "agent"
AGENT_USER = "system:serviceaccount:muster-system:muster-agent"
WATCHDOG_USER = "system:serviceaccount:muster-system:muster-fence-watchdog"
ANONYMOUS = "system:anonymous"


@dataclass(frozen=True)
class Attributes:
    """What the authorizer decides on (`authorizer.AttributesRecord`)."""

    user: str
    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def qualified(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


def request_attributes(user: str, method: str, path: str, query: Mapping[str, str]) -> Attributes:
    """The attributes of one resource request, from its method, path and query."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    namespace = ""
    if len(rest) >= 2 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else ""
    sub = "/".join(rest[2:])
    watching = query.get("watch") in ("1", "true")
    if method == "GET":
        verb = "watch" if watching else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return Attributes(user, verb, group, resource, sub, namespace, name)


def _matches(rule: Mapping[str, Any], a: Attributes) -> bool:
    def has(key: str, value: str) -> bool:
        return value in (rule.get(key) or []) or "*" in (rule.get(key) or [])

    wanted = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    resources = rule.get("resources") or []
    resource_ok = (
        wanted in resources
        or "*" in resources
        or (a.subresource != "" and f"*/{a.subresource}" in resources)
    )
    names = rule.get("resourceNames") or []
    return (
        has("verbs", a.verb)
        and has("apiGroups", a.group)
        and resource_ok
        and (not names or (a.name != "" and a.name in names))
    )


class RbacAuthorizer:
    """The RBAC authorizer over a fixed set of Role/ClusterRole/binding documents."""

    def __init__(self, docs: Iterable[Mapping[str, Any]]) -> None:
        self.docs = [d for d in docs if d]
        self.checked: list[Attributes] = []  # every decision asked for, in order
        self.denied: list[Attributes] = []

    @classmethod
    def shipped(cls, *extra: Mapping[str, Any]) -> RbacAuthorizer:
        """The RBAC of `deploy/agent/` as `kubectl apply -k` applies it (the files its
        kustomization lists, not the templates beside them), plus `extra` documents."""
        listed = yaml.safe_load((DEPLOY_AGENT / "kustomization.yaml").read_text())["resources"]
        docs: list[Mapping[str, Any]] = list(extra)
        for name in listed:
            text = (DEPLOY_AGENT / name).read_text()
            docs += [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
        return cls(docs)

    @classmethod
    def with_optional(cls, name: str) -> RbacAuthorizer:
        """The shipped RBAC plus `deploy/agent/optional/<name>.yaml`, as an operator who
        applied that optional file has it."""
        docs = list(cls.shipped().docs)
        path = DEPLOY_AGENT / "optional" / f"{name}.yaml"
        docs += [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        return cls(docs)

    def _role(self, kind: str, name: str, namespace: str) -> Mapping[str, Any] | None:
        for d in self.docs:
            meta = d.get("metadata") or {}
            scoped = kind == "ClusterRole" or meta.get("namespace") == namespace
            if d.get("kind") == kind and meta.get("name") == name and scoped:
                return d
        return None

    def _rules_for(self, user: str, namespace: str) -> list[Mapping[str, Any]]:
        rules: list[Mapping[str, Any]] = []
        for d in self.docs:
            kind = d.get("kind")
            if kind not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            bound_ns = (d.get("metadata") or {}).get("namespace", "")
            if kind == "RoleBinding" and bound_ns != namespace:
                continue
            subjects = d.get("subjects") or []
            if not any(
                s.get("kind") == "ServiceAccount"
                and user == f"system:serviceaccount:{s.get('namespace')}:{s.get('name')}"
                for s in subjects
            ):
                continue
            ref = d["roleRef"]
            role = self._role(ref["kind"], ref["name"], bound_ns)
            rules += (role or {}).get("rules") or []
        return rules

    def allows(self, a: Attributes) -> bool:
        self.checked.append(a)
        ok = any(_matches(r, a) for r in self._rules_for(a.user, a.namespace))
        if not ok:
            self.denied.append(a)
        return ok

    def forbidden(self, a: Attributes) -> dict[str, Any]:
        """The 403 Status the real server sends for a request RBAC denies."""
        resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
        scope = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
        why = f'User "{a.user}" cannot {a.verb} resource "{resource}" in API group "{a.group}" '
        why += scope
        return forbidden_status(a, why)

    def owner_refusal(self, user: str, namespace: str, obj: Mapping[str, Any]) -> Any:
        """OwnerReferencesPermissionEnforcement on a create: the 403 for an ownerReference
        with `blockOwnerDeletion: true` to an owner whose finalizers `user` may not update,
        else None."""
        plural = {(v, k): p for (v, p), k in known_kinds().items()}
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("blockOwnerDeletion") is not True:
                continue
            api_version = str(ref.get("apiVersion", ""))
            group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
            res = plural.get((api_version, str(ref.get("kind", ""))), "")
            owner = Attributes(user, "update", group, res, "finalizers", namespace, ref["name"])
            if not self.allows(owner):
                return owner
        return None


def forbidden_status(a: Attributes, why: str) -> dict[str, Any]:
    """`apierrors.NewForbidden(qualifiedResource, name, err)` as JSON."""
    named = f' "{a.name}"' if a.name else ""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"{a.qualified}{named} is forbidden: {why}",
        "reason": "Forbidden",
        "details": {"name": a.name, "group": a.group, "kind": a.resource},
        "code": 403,
    }


def owner_forbidden(created: Attributes) -> dict[str, Any]:
    """The admission plugin's refusal of the object being created (`created`)."""
    why = (
        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't "
        "set finalizers on: , <nil>"
    )
    return forbidden_status(created, why)
