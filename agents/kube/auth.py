"""Credentials that expire: exec plugins (EKS `aws eks get-token`, GKE
`gke-gcloud-auth-plugin`, AKS `kubelogin`) and OIDC tokens, for agents outside the cluster.

kubernetes-asyncio reads a kubeconfig once. `TokenRefresher` keeps its loader and hooks the
client's Configuration, so every request first renews a token within five minutes of its
expiry (`expirationTimestamp` of the ExecCredential, `exp` of the OIDC id-token), and a 401
forces a renewal before the one retry (`KubeRest.refresh`). In-cluster agents need none of
this: kubernetes-asyncio re-reads the projected service-account token itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import Configuration

log = structlog.get_logger("muster.agent.kube")


class TokenRefresher:
    """Renews the bearer token of one Configuration from its kubeconfig loader."""

    def __init__(self, loader: Any, cfg: Configuration) -> None:
        self.loader = loader
        self.cfg = cfg
        self.lock = asyncio.Lock()
        self.renewals = 0

    @classmethod
    async def load(
        cls, cfg: Configuration, config_file: str | None, context: str | None
    ) -> TokenRefresher:
        loader = await kube_config.load_kube_config(
            config_file=config_file,
            context=context,
            client_configuration=cfg,
            persist_config=False,
        )
        refresher = cls(loader, cfg)
        cfg.refresh_api_key_hook = refresher.before_request
        return refresher

    @property
    def expiring(self) -> bool:
        """Whether the credential can expire at all (exec plugin or OIDC)."""
        user = getattr(self.loader, "_user", None) or {}
        return "exec" in user or getattr(self.loader, "provider", "") == "oidc"

    async def before_request(self, _cfg: Configuration) -> None:
        """Renew when close to expiry; the loader only runs the plugin when it must."""
        if self.expiring:
            await self._renew(force=False)

    async def force(self) -> bool:
        """After a 401: renew now, whatever the token claims. False when it cannot."""
        if not self.expiring:
            return False
        try:
            await self._renew(force=True)
        except Exception as exc:  # the plugin failed: say so once per 401, keep running
            log.warning("renewing Kubernetes credentials failed", error=str(exc)[:300])
            return False
        return True

    async def _renew(self, force: bool) -> None:
        async with self.lock:
            before = self.cfg.api_key.get("BearerToken")
            if force and hasattr(self.loader, "exec_plugin_expiry"):
                del self.loader.exec_plugin_expiry
            if force and getattr(self.loader, "provider", "") == "oidc":
                await self.loader._refresh_oidc(self.loader._user["auth-provider"])
            await self.loader._load_authentication()
            token = getattr(self.loader, "token", None)
            if token:
                self.cfg.api_key["BearerToken"] = token
            if token != before:
                self.renewals += 1
                log.info("Kubernetes credentials renewed", forced=force)
