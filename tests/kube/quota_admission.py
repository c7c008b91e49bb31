"""ResourceQuota admission for the API server stand-in: a create that would take a namespace
over one of its quotas is refused with the real 403, and an admitted one is charged to the
quotas' `status.used`.

Modelled on Kubernetes (kubernetes/kubernetes, Apache-2.0):
* `staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/controller.go`:
  `checkRequest` (a quota whose `status.hard` names a resource without a `status.used` figure
  refuses with `status unknown for quota: <name>`; over when `used + requested > hard` for a
  resource the request uses; `exceeded quota: <name>, requested: <r>, used: <u>, limited:
  <h>`, each list `prettyPrint`ed: `name=quantity`, sorted, comma-joined) and the charge of
  the new usage to the quota on admission;
* `admission.NewForbidden` -> `apierrors.NewForbidden(groupResource, name, err)`: 403,
  `reason: Forbidden`, `<resource>[.<group>] "<name>" is forbidden: <err>`;
* usage per object (`pkg/quota/v1/evaluator/core/pods.go`, `generic/evaluator.go`): every
  object counts 1 of `count/<resource>[.<group>]`; pods also `pods`, services `services`;
  a pod's requests and limits (`requests.<r>`, `<r>` for cpu/memory/ephemeral-storage,
  `limits.<r>`), the containers summed, an init container's figure taken when larger.

Not modelled: quota scopes and scope selectors (a scoped quota is skipped), the quota
controller's recount (usage is never given back on delete: a test sets `status.used`).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from schemas.quantity import parse_quantity

Obj = dict[str, Any]
ResKey = tuple[str, str]  # (apiVersion, plural)
_STANDARD = ("cpu", "memory", "ephemeral-storage")
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def _qty(value: Any) -> Decimal:
    return parse_quantity(str(value))


def _container_figures(container: Obj) -> dict[str, Decimal]:
    res = container.get("resources") or {}
    requests = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    out = {f"requests.{k}": _qty(v) for k, v in requests.items()}
    out.update({f"limits.{k}": _qty(v) for k, v in (res.get("limits") or {}).items()})
    return out


def _pod_usage(pod: Obj) -> dict[str, Decimal]:
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for c in spec.get("containers") or []:
        for k, v in _container_figures(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in spec.get("initContainers") or []:
        for k, v in _container_figures(c).items():
            total[k] = max(total.get(k, Decimal(0)), v)
    for name in _STANDARD:
        if f"requests.{name}" in total:
            total[name] = total[f"requests.{name}"]
    total["pods"] = Decimal(1)
    return total


def usage(res: ResKey, obj: Obj) -> dict[str, Decimal]:
    """What creating `obj` adds to a namespace's quota usage."""
    version, plural = res
    group = version.rsplit("/", 1)[0] if "/" in version else ""
    out = {f"count/{plural}.{group}" if group else f"count/{plural}": Decimal(1)}
    if res == ("v1", "pods"):
        out.update(_pod_usage(obj))
    if res == ("v1", "services"):
        out["services"] = Decimal(1)
    return out


def _show(resource: str, value: Decimal) -> str:
    """A quantity as Kubernetes prints it: cpu in cores or millicores, byte figures with the
    largest exact binary suffix, counts as integers."""
    if resource.endswith("cpu"):
        return str(int(value)) if value == value.to_integral_value() else f"{int(value * 1000)}m"
    for suffix, unit in _BINARY:
        if ("memory" in resource or "storage" in resource) and value and value % unit == 0:
            return f"{int(value // unit)}{suffix}"
    return str(int(value)) if value == value.to_integral_value() else str(value)


def _pretty(figures: dict[str, Decimal]) -> str:
    return ",".join(f"{k}={_show(k, figures[k])}" for k in sorted(figures))


def admit(quotas: list[Obj], res: ResKey, obj: Obj) -> tuple[str | None, list[Obj]]:
    """The refusal text of the first quota `obj` does not fit (and no quota charged), or None
    and the quotas charged with it (their `status.used` updated in place)."""
    delta = usage(res, obj)
    charges: list[tuple[Obj, dict[str, Decimal]]] = []
    for quota in quotas:
        spec = quota.get("spec") or {}
        if spec.get("scopes") or spec.get("scopeSelector"):
            continue
        status = quota.get("status") or {}
        hard = {k: _qty(v) for k, v in (status.get("hard") or {}).items()}
        used_raw = status.get("used") or {}
        if any(k not in used_raw for k in hard):
            return f"status unknown for quota: {quota['metadata']['name']}", []
        used = {k: _qty(v) for k, v in used_raw.items()}
        requested = {k: v for k, v in delta.items() if k in hard and v > 0}
        over = [k for k, v in requested.items() if used.get(k, Decimal(0)) + v > hard[k]]
        if over:
            return (
                f"exceeded quota: {quota['metadata']['name']}, "
                f"requested: {_pretty({k: requested[k] for k in over})}, "
                f"used: {_pretty({k: used.get(k, Decimal(0)) for k in over})}, "
                f"limited: {_pretty({k: hard[k] for k in over})}"
            ), []
        if requested:
            charges.append((quota, {k: used.get(k, Decimal(0)) + v for k, v in requested.items()}))
    for quota, new in charges:
        used_out = quota["status"].setdefault("used", {})
        used_out.update({k: _show(k, v) for k, v in new.items()})
    return None, [quota for quota, _ in charges]
