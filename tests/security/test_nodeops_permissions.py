"""Node operations are an operator's: on a real nats-server running the generated
authorization, the admin's cordon reaches the cluster's agent and is answered, a team's is
refused by the server and never delivered."""

from __future__ import annotations

from typing import Any

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shell.natsio import flush
from tests.security.conftest import AuthNats
from tests.support import wait_for

SUBJECT = "muster.agent.east.nodeops"
ASK = b'{"op": "cordon", "node": "east-a100-0"}'


async def test_only_the_admin_reaches_an_agents_node_operations(auth_nats: AuthNats) -> None:
    agent = await auth_nats.connect("agent-east")
    heard: list[bytes] = []

    async def answer(msg: Any) -> None:
        heard.append(msg.data)
        await msg.respond(b'{"ok": true, "op": "cordon", "nodes": ["east-a100-0"]}')

    await agent.subscribe(SUBJECT, cb=answer)
    await flush(agent)

    alpha = await auth_nats.connect("team-alpha")
    with pytest.raises((NatsTimeout, NoRespondersError)):
        await alpha.request(SUBJECT, ASK, timeout=1)
    await wait_for(
        lambda: any(SUBJECT in str(e) for e in auth_nats.errors.get("team-alpha", [])),
        5,
        what="the server refusing team-alpha's publish",
    )
    assert heard == []

    admin = await auth_nats.connect("admin")
    reply = await admin.request(SUBJECT, ASK, timeout=5)
    assert b'"ok": true' in reply.data and heard == [ASK]
    west = await auth_nats.connect("agent-west")
    with pytest.raises((NatsTimeout, NoRespondersError)):
        await west.request(SUBJECT, ASK, timeout=1)
    assert heard == [ASK]
