"""A namespace's ResourceQuota, checked before an attempt's objects are created.

The API server refuses a create over quota with 403 Forbidden; for the pods a controller
creates (a Job's, an operator's) that refusal goes to the controller, which retries and
records an Event, while the workload object sits there and the broker waits for a start that
never comes. So the agent compares the attempt's pods with the namespace's quotas first and
refuses the dispatch itself, with the API server's own wording, and the broker places the job
elsewhere (docs/kubernetes.md "ResourceQuota").

The rule is ResourceQuota admission's (kubernetes/kubernetes, Apache-2.0,
`staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/controller.go`,
`checkRequest`): for every quota, the resources it limits that the request uses; over when
`used + requested > hard` for one of them; the message `exceeded quota: <quota>, requested:
<r>, used: <u>, limited: <h>`, each list `name=quantity` sorted by name and joined by commas
(`prettyPrint`). A pod uses `pods` 1, `requests.cpu` / `cpu`, `requests.memory` / `memory`
and `requests.<extended resource>` (the pod evaluator, `pkg/quota/v1/evaluator/core/pods.go`).
Quotas with scopes are not evaluated here (the API server still applies them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from agents.kube.client import KubeApiError, KubeRest
from schemas.agent import Dispatch
from schemas.quantity import QuantityError, cpu_milli, memory_bytes
from shell.tasks import Shared

Usage = dict[str, int]  # resource name -> millicores (cpu), bytes (memory) or a count

_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


class QuotaStatus(msgspec.Struct, omit_defaults=True):
    hard: dict[str, str] = {}
    used: dict[str, str] = {}


class QuotaSpec(msgspec.Struct, omit_defaults=True, rename="camel"):
    hard: dict[str, str] = {}
    scopes: list[str] = []
    scope_selector: dict[str, Any] | None = None


class QuotaMeta(msgspec.Struct, omit_defaults=True):
    name: str = ""


class KResourceQuota(msgspec.Struct, omit_defaults=True):
    """The fields of a v1 ResourceQuota the check reads."""

    metadata: QuotaMeta = msgspec.field(default_factory=QuotaMeta)
    spec: QuotaSpec = msgspec.field(default_factory=QuotaSpec)
    status: QuotaStatus = msgspec.field(default_factory=QuotaStatus)


class QuotaList(msgspec.Struct):
    items: list[KResourceQuota] = []


_list_decoder = msgspec.json.Decoder(QuotaList)


def _cpu(resource: str) -> bool:
    return resource in ("cpu", "requests.cpu", "limits.cpu")


def amount(resource: str, quantity: str) -> int:
    """A quantity in the unit `Usage` keeps for `resource`."""
    return cpu_milli(quantity) if _cpu(resource) else memory_bytes(quantity)


def show(resource: str, value: int) -> str:
    """`value` as Kubernetes prints the quantity (canonical form)."""
    if _cpu(resource):
        return str(value // 1000) if value % 1000 == 0 else f"{value}m"
    for suffix, unit in _BINARY:
        if value and value % unit == 0 and "memory" in resource:
            return f"{value // unit}{suffix}"
    return str(value)


def attempt_usage(cmd: Dispatch, gpu_resource: str) -> Usage:
    """What the attempt's pods add to the namespace's quota usage (requests; one pod per
    assigned replica)."""
    podsets = {p.name: p for p in cmd.spec.gang}
    usage: Usage = {}

    def add(resource: str, value: int) -> None:
        if value:
            usage[resource] = usage.get(resource, 0) + value

    for a in cmd.assignment:
        ps = podsets.get(a.podset)
        n = len(a.nodes)
        add("pods", n)
        if ps is None:
            continue
        cpu, memory = cpu_milli(ps.cpu) * n, memory_bytes(ps.memory) * n
        for name, value in (("cpu", cpu), ("memory", memory)):
            add(name, value)
            add(f"requests.{name}", value)
        add(f"requests.{gpu_resource}", ps.gpu * n)
    return usage


def _pretty(resources: Mapping[str, int]) -> str:
    return ",".join(f"{k}={show(k, resources[k])}" for k in sorted(resources))


def exceeded(quota: KResourceQuota, usage: Mapping[str, int]) -> str | None:
    """The API server's refusal text for `usage` against one quota, or None if it fits."""
    hard_raw = quota.status.hard or quota.spec.hard
    if quota.spec.scopes or quota.spec.scope_selector:
        return None
    requested, used, hard = {}, {}, {}
    try:
        for resource, limit in hard_raw.items():
            want = usage.get(resource, 0)
            if want <= 0:
                continue
            have = amount(resource, quota.status.used.get(resource, "0"))
            cap = amount(resource, limit)
            if have + want > cap:
                requested[resource], used[resource], hard[resource] = want, have, cap
    except QuantityError:
        return None  # the API server validated it; an unreadable figure is not ours to judge
    if not requested:
        return None
    return (
        f"exceeded quota: {quota.metadata.name}, requested: {_pretty(requested)}, "
        f"used: {_pretty(used)}, limited: {_pretty(hard)}"
    )


def quota_refusal(quotas: list[KResourceQuota], usage: Mapping[str, int]) -> str | None:
    """The first quota the usage exceeds, in the API server's words; None: it fits."""
    for quota in quotas:
        why = exceeded(quota, usage)
        if why is not None:
            return why
    return None


class QuotaReads:
    """The namespaces' quotas, read once for every Dispatch that asks while a read of the same
    namespace is on its way. A burst of Dispatches is carried out concurrently, so their own
    reads would all see the namespace as it was before any of them created a pod; one shared
    read sees no less, and spends one request of the agent's API budget instead of one a
    Dispatch (a third of what a Dispatch costs: the quota, a Service, a Job)."""

    def __init__(self, rest: Callable[[], KubeRest]) -> None:
        self._rest = rest
        self._reading: Shared[str, bytes | None] = Shared()
        self.reads = 0  # lists made (one per burst, not one per Dispatch)

    async def refusal(self, namespace: str, usage: Mapping[str, int]) -> str | None:
        """Why the namespace's quotas refuse `usage`, as the broker should read it; None: they
        do not (or cannot be read: the API server's own refusal then still reaches the
        broker)."""
        data = await self._reading.run(namespace, lambda: self._read(namespace))
        if data is None:
            return None
        try:
            quotas = _list_decoder.decode(data).items
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None  # not a quota list we can read: the API server still decides
        why = quota_refusal(quotas, usage)
        if why is None:
            return None
        return quota_message(namespace, why)

    async def _read(self, namespace: str) -> bytes | None:
        self.reads += 1
        try:
            data = await self._rest().request(
                "GET", f"/api/v1/namespaces/{namespace}/resourcequotas"
            )
        except KubeApiError as exc:
            if exc.status in (403, 404):
                return None
            raise
        return data or b"{}"


def quota_message(namespace: str, why: str) -> str:
    """The placement failure the broker records for a refusal by a namespace's quota."""
    return (
        f"namespace {namespace}: {why}; the attempt was not started here. Raise the "
        "ResourceQuota, or wait for the namespace's other workloads to finish"
    )
