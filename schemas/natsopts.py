"""How to reach NATS: one Struct shared by the broker, the agents and the client.

`connect_kwargs` reads certificate files only when TLS is configured.
"""

from __future__ import annotations

import ssl
from typing import Any

import msgspec


class NatsOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    url: str = "nats://127.0.0.1:4222"
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: str | None = None  # path to a .creds file (JWT + nkey seed)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    name: str | None = None
    # `_INBOX_<user>` under the generated NATS permissions (`muster nats-config`).
    inbox_prefix: str | None = None
    # The team a client acts as: its API calls go to `muster.api.<team>.<verb>` and it follows
    # events on `muster.events.team.<team>.<job_id>`. Not a connection setting.
    team: str | None = None

    def connect_kwargs(self, reconnects: int = -1) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`: reconnect quickly, forever (a service) or
        `reconnects` times (a short-lived tool, which should fail rather than hang)."""
        kwargs: dict[str, Any] = {
            "servers": [u.strip() for u in self.url.split(",") if u.strip()],
            "max_reconnect_attempts": reconnects,
            "reconnect_time_wait": 0.5,
            "connect_timeout": 5,
            "allow_reconnect": True,
        }
        if self.name:
            kwargs["name"] = self.name
        if self.inbox_prefix:
            kwargs["inbox_prefix"] = self.inbox_prefix
        if self.user is not None:
            kwargs["user"] = self.user
        if self.password is not None:
            kwargs["password"] = self.password
        if self.token is not None:
            kwargs["token"] = self.token
        if self.creds is not None:
            kwargs["user_credentials"] = self.creds
        if self.tls_ca or self.tls_cert:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kwargs["tls"] = ctx
        return kwargs
