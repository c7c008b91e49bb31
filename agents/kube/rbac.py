"""The Kubernetes permissions the kube backend needs, as data (no I/O).

`deploy/agent/rbac.yaml` must grant exactly these; `tests/kube/test_deploy.py` checks the YAML
against this module and this module against the requests the backend really makes.

* cluster-wide: list+watch nodes (inventory) and pods (foreign usage on every node, and the
  status of Muster's own pods);
* in the workload namespace: create/list/delete of every kind Muster creates
  (`manifests.OWNED_RESOURCES`; list = startup scan, cancel and garbage collection by label),
  watch on those with a status (`status.STATUS_RESOURCES`: the operator's verdict, e.g. a
  PyTorchJob Failed while its pods still run), and patch on pods (the
  `muster.dev/checkpoint-request` annotation). `get` and `update` on workload objects are not
  needed.
"""

from __future__ import annotations

from typing import NamedTuple

from agents.kube.manifests import OWNED_RESOURCES
from agents.kube.status import STATUS_RESOURCES


class Rule(NamedTuple):
    group: str  # "" = the core API group
    resource: str
    verb: str


CLUSTER_RULES: frozenset[Rule] = frozenset(
    Rule("", res, verb) for res in ("nodes", "pods") for verb in ("list", "watch")
)


def _group(api_version: str) -> str:
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def namespace_rules() -> frozenset[Rule]:
    """Rules for the Role in the workload namespace (what the ClusterRole already grants is
    left out)."""
    rules = {
        Rule(_group(r.api_version), r.plural, verb)
        for r in OWNED_RESOURCES
        for verb in ("create", "list", "delete")
    }
    rules |= {Rule(_group(r.api_version), r.plural, "watch") for r in STATUS_RESOURCES}
    rules.add(Rule("", "pods", "patch"))
    return frozenset(rules - CLUSTER_RULES)


NAMESPACE_RULES: frozenset[Rule] = namespace_rules()
