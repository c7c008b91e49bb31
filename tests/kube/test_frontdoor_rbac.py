"""The front door's shipped Role grants exactly what agents/kube/rbac.py says it needs (the
end-to-end test checks the requests it makes stay within it)."""

from __future__ import annotations

from agents.kube.rbac import NAMESPACE_RULES, frontdoor_rules
from tests.kube.deploy_tree import all_docs, rbac_rules


def test_the_shipped_frontdoor_role_is_frontdoor_rules_bound_to_the_agent() -> None:
    assert rbac_rules("Role", "frontdoor") == frontdoor_rules()
    (binding,) = [
        d
        for _, d in all_docs()
        if d.get("kind") == "RoleBinding" and d["roleRef"]["name"] == "muster-agent-frontdoor"
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "muster-agent", "namespace": "muster-system"}
    ]


def test_frontdoor_rules_add_the_status_and_events_the_backend_never_writes() -> None:
    extra = frontdoor_rules() - NAMESPACE_RULES
    assert ("", "events", "create") in extra
    assert ("kubeflow.org", "pytorchjobs/status", "patch") in extra
    assert ("batch", "jobs/status", "patch") not in frontdoor_rules()  # annotations only
