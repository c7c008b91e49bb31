"""The Kubernetes permissions the kube backend needs, as data (no I/O), derived from the kind
adapters (`kinds.registry`), so a new kind brings its own rules.

`deploy/agent/rbac.yaml` must grant exactly these; `tests/kube/test_deploy.py` checks the YAML
against this module and this module against the requests the backend really makes.

* cluster-wide: list+watch nodes (inventory) and pods (foreign usage on every node, and the
  status of Muster's own pods);
* in the workload namespace: create/list/delete of every kind Muster creates (list = startup
  scan, cancel and garbage collection by label), watch on those with a status (the operator's
  verdict, e.g. a PyTorchJob Failed while its pods still run), patch on pods (the
  checkpoint-request annotation), and get/create/patch on Leases (the cluster's one fence
  Lease, agents/kube/fence.py). `get`, `patch` and `update` on workload objects are not
  needed. The fence watchdog's own Role is `kinds.registry.watchdog_rules`.
"""

from __future__ import annotations

from kinds.registry import CLUSTER_RULES, Rule, namespace_rules

NAMESPACE_RULES = namespace_rules()

__all__ = ["CLUSTER_RULES", "NAMESPACE_RULES", "Rule", "frontdoor_rules", "namespace_rules"]


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
