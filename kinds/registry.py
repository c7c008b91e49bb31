"""Every kind Muster handles, and the lookups the broker, the agent, RBAC and tests share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kinds.adapter import Adapter
from kinds.base import SERVICE, KindError, Resource
from kinds.batch import BatchJob, Pod
from kinds.jobset import JobSet
from kinds.kubeflow import ADAPTERS as TRAINING
from kinds.podgroup import PodGroup
from kinds.ray import RayCluster, RayJob
from kinds.trainer import TrainJob
from kinds.volcano import VolcanoJob

ADAPTERS: tuple[Adapter, ...] = (
    BatchJob(),
    *TRAINING,
    JobSet(),
    VolcanoJob(),
    RayJob(),
    RayCluster(),
    TrainJob(),
    Pod(),
    PodGroup(),
)


def supported() -> str:
    """The kinds, for error messages."""
    return "; ".join(f"{a.resource.api_version} {a.resource.kind}" for a in ADAPTERS)


def adapter_for(api_version: str, kind: str) -> Adapter:
    for adapter in ADAPTERS:
        if adapter.handles(api_version, kind):
            return adapter
    raise KindError(
        f"kind: {api_version} {kind} is not a job kind Muster can run; supported: "
        f"{supported()}. Otherwise write a Muster JobSpec with a `gang` list"
    )


def adapter_of(manifest: Mapping[str, Any]) -> Adapter:
    return adapter_for(str(manifest.get("apiVersion", "")), str(manifest.get("kind", "")))


def _unique(resources: list[Resource]) -> tuple[Resource, ...]:
    out: list[Resource] = []
    for r in resources:
        if r not in out:
            out.append(r)
    return tuple(out)


# Every kind the agent may create (and so list, delete and garbage-collect by label).
OWNED_RESOURCES: tuple[Resource, ...] = _unique([SERVICE, *(a.created for a in ADAPTERS)])
# The kinds whose objects carry a verdict worth watching (not Services, and not Pods: they are
# watched cluster-wide anyway).
STATUS_RESOURCES: tuple[Resource, ...] = _unique([a.created for a in ADAPTERS if a.has_status])


class Rule(NamedTuple):
    group: str  # "" = the core API group
    resource: str
    verb: str


# Cluster-wide: list+watch nodes (inventory) and pods (foreign usage on every node, and the
# status of Muster's own pods).
CLUSTER_RULES: frozenset[Rule] = frozenset(
    Rule("", res, verb) for res in ("nodes", "pods") for verb in ("list", "watch")
)


def namespace_rules() -> frozenset[Rule]:
    """The Role in the workload namespace: create/list/delete every owned kind, watch those
    with a status, patch pods (the checkpoint-request annotation), and get/create/patch the
    cluster's fence Lease. What the ClusterRole already grants is left out."""
    rules = {
        Rule(r.group, r.plural, v) for r in OWNED_RESOURCES for v in ("create", "list", "delete")
    }
    rules |= {Rule(r.group, r.plural, "watch") for r in STATUS_RESOURCES}
    rules.add(Rule("", "pods", "patch"))
    # a running elastic attempt's replica count (Adapter.resize_patch)
    rules |= {
        Rule((a.resized or a.created).group, (a.resized or a.created).plural, "patch")
        for a in ADAPTERS
        if a.resizable
    }
    # one Lease per cluster carries the broker-granted fence (agents/kube/fence.py)
    rules |= {Rule("coordination.k8s.io", "leases", v) for v in ("get", "create", "patch")}
    return frozenset(rules - CLUSTER_RULES)


# The kinds whose objects carry the fence annotation (every owned kind but Services, which run
# nothing): what the fence watchdog lists and deletes.
FENCED_RESOURCES: tuple[Resource, ...] = tuple(r for r in OWNED_RESOURCES if r != SERVICE)


def watchdog_rules() -> frozenset[Rule]:
    """The fence watchdog's Role in the workload namespace: read the fence Lease, list and
    delete the fenced kinds, nothing else."""
    rules = {Rule(r.group, r.plural, v) for r in FENCED_RESOURCES for v in ("list", "delete")}
    return frozenset(rules | {Rule("coordination.k8s.io", "leases", "get")})


def known_kinds() -> dict[tuple[str, str], str]:
    """(apiVersion, plural) -> kind of every resource the agent reads or writes, for an API
    server stand-in that must serve exactly these."""
    out = {("v1", "nodes"): "Node", ("v1", "namespaces"): "Namespace"}
    for r in OWNED_RESOURCES:
        out[(r.api_version, r.plural)] = r.kind
    return out


def markdown_table() -> str:
    """The kinds table of docs/kinds.md (a test keeps the page equal to this)."""
    rows = [
        "| kind | apiVersion | podsets | retries disabled by | verdict read from |",
        "|---|---|---|---|---|",
    ]
    for a in ADAPTERS:
        r = a.resource
        rows.append(
            f"| {r.kind} | `{r.api_version}` | {a.podsets_doc} | {a.retries_doc} "
            f"| {a.verdict_doc} |"
        )
    return "\n".join(rows)
