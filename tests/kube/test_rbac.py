"""The stand-in authorizes as the real API server does, against the shipped RBAC of
deploy/agent/ (tests/kube/rbac_authz.py), and the shipped roles grant no more than needed."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.kube.conftest import AGENT_TOKEN, NS, PODS, pod
from tests.kube.fake_apiserver import FakeApiServer

WORKLOAD_TOKEN = "workload-token"
WORKLOAD_USER = f"system:serviceaccount:{NS}:default"
AGENT = "system:serviceaccount:muster-system:muster-agent"


async def _call(
    server: FakeApiServer, method: str, path: str, token: str, body: Any = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    if method == "PATCH":
        headers["Content-Type"] = "application/merge-patch+json"
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.request(method, server.url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


async def test_a_request_outside_the_roles_gets_the_real_forbidden_status(
    apiserver: FakeApiServer,
) -> None:
    code, body = await _call(apiserver, "GET", f"/api/v1/namespaces/{NS}/secrets/s", AGENT_TOKEN)
    assert code == 403
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'secrets "s" is forbidden: User "{AGENT}" cannot get resource "secrets" '
        f'in API group "" in the namespace "{NS}"',
        "reason": "Forbidden",
        "details": {"name": "s", "group": "", "kind": "secrets"},
        "code": 403,
    }
    code, body = await _call(apiserver, "GET", "/apis/batch/v1/jobs", AGENT_TOKEN)
    assert code == 403
    assert body["message"] == (
        f'jobs.batch is forbidden: User "{AGENT}" cannot list resource "jobs" in API group '
        '"batch" at the cluster scope'
    )
    apiserver.default_user = "system:anonymous"  # a token that maps to no one
    code, body = await _call(apiserver, "GET", "/api/v1/nodes", "no-such-token")
    assert code == 403 and 'User "system:anonymous" cannot list resource "nodes"' in body["message"]
    # What the roles do grant goes through.
    assert (await _call(apiserver, "GET", "/api/v1/nodes", AGENT_TOKEN))[0] == 200


async def test_a_workload_may_patch_pods_and_read_none(apiserver: FakeApiServer) -> None:
    """RBAC cannot name a workload's own pod (its name is generated), so the workload Role is
    `patch` alone: it cannot read, list or watch other pods, nor touch any other kind."""
    apiserver.users[WORKLOAD_TOKEN] = WORKLOAD_USER
    apiserver.put(PODS, pod("w-0", "n1", namespace=NS))
    item = f"{PODS}/w-0"
    code, _ = await _call(
        apiserver, "PATCH", item, WORKLOAD_TOKEN, {"metadata": {"annotations": {"a": "1"}}}
    )
    assert code == 200
    for method, path in (
        ("GET", item),
        ("GET", PODS),
        ("GET", f"{PODS}?watch=true"),
        ("DELETE", item),
        ("GET", f"{item}/log"),
        ("GET", f"/apis/batch/v1/namespaces/{NS}/jobs"),
        ("GET", f"/api/v1/namespaces/{NS}/secrets"),
        ("GET", "/api/v1/pods"),
    ):
        code, body = await _call(apiserver, method, path, WORKLOAD_TOKEN)
        assert code == 403, (method, path)
        assert body["reason"] == "Forbidden" and WORKLOAD_USER in body["message"]
