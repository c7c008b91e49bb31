"""An agent outside the cluster with an OIDC kubeconfig (`auth-provider: oidc`): when the API
server stops accepting its id-token, the agent renews it from the identity provider with its
refresh token (a real token endpoint on 127.0.0.1, found through the issuer's discovery
document) and carries on without losing a watch event. A provider that refuses is logged and
the agent keeps running on what it has."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from agents.kube.backend import KubeBackend
from schemas.agent import NodeUpsert
from tests.kube.conftest import NODES, Recorder, make_config, node
from tests.kube.fake_apiserver import FakeApiServer

CLIENT_ID = "muster-agent"
CLIENT_SECRET = "s3cret"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


ISSUED = itertools.count(1)


def id_token(subject: str, expires_in_s: float) -> str:
    """An unsigned JWT of the shape an IdP issues (the client reads only `exp`); `jti` makes
    every token distinct."""
    header = _b64(json.dumps({"alg": "RS256", "typ": "JWT"}).encode())
    claims = {
        "sub": subject,
        "exp": int(time.time() + expires_in_s),
        "iss": "muster-test",
        "jti": str(next(ISSUED)),
    }
    return f"{header}.{_b64(json.dumps(claims).encode())}.{_b64(b'signature')}"


@dataclass
class IdentityProvider:
    """Discovery document and token endpoint; each refresh token is good once (rotation)."""

    url: str = ""
    refresh_tokens: dict[str, str] = field(default_factory=dict)  # refresh -> next id-token
    grants: int = 0
    refused: int = 0

    async def discovery(self, _: web.Request) -> web.Response:
        return web.json_response({"issuer": self.url, "token_endpoint": f"{self.url}/token"})

    async def token(self, request: web.Request) -> web.Response:
        form = await request.post()
        expected = "Basic " + base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
        refresh = str(form.get("refresh_token", ""))
        if (
            request.headers.get("Authorization") != expected
            or form.get("grant_type") != "refresh_token"
            or refresh not in self.refresh_tokens
        ):
            self.refused += 1
            return web.json_response({"error": "invalid_grant"}, status=400)
        self.grants += 1
        issued = self.refresh_tokens.pop(refresh)
        rotated = f"{refresh}+"
        self.refresh_tokens[rotated] = id_token(f"agent-{self.grants + 1}", 3600)
        return web.json_response(
            {"id_token": issued, "refresh_token": rotated, "token_type": "Bearer"}
        )


@pytest_asyncio.fixture
async def idp(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[IdentityProvider]:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # the client trusts proxy variables
    provider = IdentityProvider()
    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", provider.discovery)
    app.router.add_post("/token", provider.token)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    provider.url = f"http://127.0.0.1:{port}"
    yield provider
    await runner.cleanup()


def write_kubeconfig(tmp: Path, server: str, issuer: str, token: str, refresh: str) -> Path:
    oidc = {
        "client-id": CLIENT_ID,
        "client-secret": CLIENT_SECRET,
        "idp-issuer-url": issuer,
        "id-token": token,
        "refresh-token": refresh,
    }
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"auth-provider": {"name": "oidc", "config": oidc}}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.asynccontextmanager
async def agent_on(kubeconfig: Path) -> AsyncIterator[tuple[KubeBackend, Recorder]]:
    """The kube backend of cluster c1 with this kubeconfig, started, and what it emits."""
    backend = KubeBackend("c1", make_config(kubeconfig=str(kubeconfig)))
    rec = Recorder()
    await backend.start(rec)
    try:
        yield backend, rec
    finally:
        await backend.stop()


def names(rec: Recorder) -> set[str]:
    return {e.node.name for e in rec.of(NodeUpsert)}


async def test_a_rejected_id_token_is_renewed_from_the_provider(
    apiserver: FakeApiServer, idp: IdentityProvider, tmp_path: Path
) -> None:
    first, second = id_token("agent-1", 3600), id_token("agent-2", 3600)
    idp.refresh_tokens = {"r1": second}
    kubeconfig = write_kubeconfig(tmp_path, apiserver.url, idp.url, first, "r1")
    apiserver.tokens = {first}
    apiserver.put(NODES, node("n0"))
    async with agent_on(kubeconfig) as (backend, rec):
        assert backend.refresher is not None and backend.refresher.expiring
        await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
        apiserver.put(NODES, node("n1"))
        await rec.wait_for(lambda: "n1" in names(rec))
        assert idp.grants == 0 and apiserver.unauthorized == 0  # no trip to the provider
        nr = backend.node_reflector
        assert nr is not None
        # The API server stops accepting the first token (revoked, or its key rotated).
        apiserver.tokens = {second}
        apiserver.reset_watches("nodes")
        apiserver.put(NODES, node("n2"))
        await rec.wait_for(lambda: "n2" in names(rec), timeout=30)
        assert apiserver.unauthorized >= 1
        assert idp.grants == 1 and backend.rest.refreshes >= 1
        assert nr.lists == 1  # resumed from its resourceVersion: nothing lost, no re-list
        # The provider rotated the refresh token; the next renewal uses the new one.
        apiserver.tokens = {idp.refresh_tokens["r1+"]}
        apiserver.reset_watches("nodes")
        apiserver.put(NODES, node("n3"))
        await rec.wait_for(lambda: "n3" in names(rec), timeout=30)
        assert idp.grants == 2 and idp.refused == 0


async def test_a_provider_that_refuses_leaves_the_agent_running(
    apiserver: FakeApiServer, idp: IdentityProvider, tmp_path: Path
) -> None:
    token = id_token("agent-1", 3600)
    kubeconfig = write_kubeconfig(tmp_path, apiserver.url, idp.url, token, "revoked")
    apiserver.tokens = {token}
    apiserver.put(NODES, node("n0"))
    async with agent_on(kubeconfig) as (backend, rec):
        await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
        assert backend.refresher is not None
        assert await backend.refresher.force() is False  # refused: said once, not raised
        assert idp.refused == 1
        apiserver.put(NODES, node("n1"))  # the token it holds still works
        await rec.wait_for(lambda: "n1" in names(rec))


async def test_an_expired_id_token_is_renewed_before_the_first_request(
    apiserver: FakeApiServer, idp: IdentityProvider, tmp_path: Path
) -> None:
    fresh = id_token("agent-2", 3600)
    idp.refresh_tokens = {"r1": fresh}
    kubeconfig = write_kubeconfig(tmp_path, apiserver.url, idp.url, id_token("a", -60), "r1")
    apiserver.tokens = {fresh}
    async with agent_on(kubeconfig) as (_, rec):
        await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
        apiserver.put(NODES, node("n1"))
        await rec.wait_for(lambda: "n1" in names(rec))
        assert idp.grants == 1 and apiserver.unauthorized == 0
