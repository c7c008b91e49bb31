"""The Kubernetes permissions the kube backend needs, as data (no I/O), derived from the kind
adapters (`kinds.registry`), so a new kind brings its own rules.

`deploy/agent/rbac.yaml` must grant exactly these; `tests/kube/test_deploy.py` checks the YAML
against this module and this module against the requests the backend really makes, and the
API server stand-in enforces the YAML on every request the agent's tests make
(`tests/kube/rbac_authz.py`).

* cluster-wide: list+watch nodes (inventory) and pods (foreign usage on every node, and the
  status of Muster's own pods), and get nodes: with `node_label_selector` set, a node that
  leaves the watch is read to tell a deleted node from one that stopped matching;
* in the workload namespace: create/list/delete of every kind Muster creates (list = startup
  scan, cancel and garbage collection by label), watch on those with a status (the operator's
  verdict, e.g. a PyTorchJob Failed while its pods still run), patch on pods (the
  checkpoint-request annotation), get on pods/log (`muster logs`), update on jobs/finalizers
  (the indexed Job owns its Service with `blockOwnerDeletion`, which the
  OwnerReferencesPermissionEnforcement admission plugin allows only to who may set the
  owner's finalizers), list on ResourceQuotas (an attempt over the namespace's quota is
  refused before it is created, agents/kube/quota.py), and get/create/patch on Leases (the
  cluster's one fence Lease, agents/kube/fence.py), and patch on the kinds whose running
  size can change (`Adapter.resizable`: a Dispatch revision of an elastic attempt). `get`
  and `update` on workload objects are not needed. The fence watchdog's own Role is
  `kinds.registry.watchdog_rules`.

Optional, with `kube.autoscaling` (agents/kube/pools.py; deploy/agent/optional/
autoscaling-rbac.yaml grants exactly `AUTOSCALING_CLUSTER_RULES` and
`AUTOSCALING_NAMESPACE_RULES`): list+watch Karpenter NodePools and NodeClaims cluster-wide, and
in the workload namespace create/delete/list/watch ProvisioningRequests and create/delete the
PodTemplates they reference (placeholder pods use the pods verbs above).
"""

from __future__ import annotations

from kinds.registry import CLUSTER_RULES as KIND_CLUSTER_RULES
from kinds.registry import Rule, namespace_rules

CLUSTER_RULES: frozenset[Rule] = KIND_CLUSTER_RULES | {Rule("", "nodes", "get")}
NAMESPACE_RULES: frozenset[Rule] = namespace_rules() | {
    Rule("", "pods/log", "get"),
    Rule("batch", "jobs/finalizers", "update"),
    Rule("", "resourcequotas", "list"),
}

AUTOSCALING_CLUSTER_RULES: frozenset[Rule] = frozenset(
    Rule("karpenter.sh", res, verb)
    for res in ("nodepools", "nodeclaims")
    for verb in ("list", "watch")
)
AUTOSCALING_NAMESPACE_RULES: frozenset[Rule] = frozenset(
    {
        *(
            Rule("autoscaling.x-k8s.io", "provisioningrequests", v)
            for v in ("create", "delete", "list", "watch")
        ),
        Rule("", "podtemplates", "create"),
        Rule("", "podtemplates", "delete"),
    }
)

__all__ = [
    "AUTOSCALING_CLUSTER_RULES",
    "AUTOSCALING_NAMESPACE_RULES",
    "CLUSTER_RULES",
    "NAMESPACE_RULES",
    "Rule",
    "frontdoor_rules",
    "namespace_rules",
]


def frontdoor_rules() -> frozenset[Rule]:
    """The front door's Role in each namespace it serves (agents/kube/frontdoor.py): list,
    get and patch (the finalizer and annotations) on every kind it takes, patch on the status
    of those that get the condition, and create on Events."""
    from agents.kube.frontdoor import WATCHED, suspend_of  # the front door imports the broker

    rules = {Rule("", "events", "create")}
    for adapter in WATCHED:
        r = adapter.resource
        rules |= {Rule(r.group, r.plural, v) for v in ("list", "get", "patch")}
        if suspend_of(r).conditions:
            rules.add(Rule(r.group, f"{r.plural}/status", "patch"))
    return frozenset(rules)
