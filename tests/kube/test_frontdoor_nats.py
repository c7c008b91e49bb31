"""The NATS permissions of an agent whose front door submits for a team, on a real nats-server
running the generated authorization: it may submit to that team's queues, call that team's API
and hear its job events, and the broker may answer it; nothing of another team's."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from broker.natsconfig import render
from schemas.config import BrokerConfig, QueueConfig
from shell.natsio import flush
from tests.kube.deploy_tree import needs_nats
from tests.security.conftest import start_auth_nats
from tests.support import wait_for

CONFIG = BrokerConfig(
    queues=[QueueConfig(name="research", team="research"), QueueConfig(name="prod", team="prod")]
)


def test_an_unknown_team_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="own no queue"):
        render(CONFIG, ["east"], frontdoor={"east": ["nobody"]})


def test_without_a_front_door_the_agent_may_not_submit() -> None:
    plain = render(CONFIG, ["east"])
    assert '"muster.submit.research"' not in plain.split('"agent-east"')[1].split("}")[0]


@needs_nats
async def test_the_front_door_agent_submits_only_for_its_teams(tmp_path: Path) -> None:
    conf = render(CONFIG, ["east"], frontdoor={"east": ["research"]})
    proc, server = await start_auth_nats(tmp_path, conf)
    try:
        broker, east = await server.connect("broker"), await server.connect("agent-east")
        seen: list[str] = []

        async def answer(msg: Any) -> None:
            seen.append(msg.subject)
            if msg.reply:
                await msg.respond(b"ok")

        await broker.subscribe("muster.>", cb=answer)
        await flush(broker)
        # Its team's submit and API subjects get an answer through its own inbox.
        assert (await east.request("muster.submit.research", b"{}", timeout=5)).data == b"ok"
        assert (await east.request("muster.api.research.get", b"{}", timeout=5)).data == b"ok"
        # Another team's are refused by the server: nobody hears them.
        for subject in ("muster.submit.prod", "muster.api.prod.cancel", "muster.api.get"):
            with pytest.raises((NatsTimeout, NoRespondersError)):
                await east.request(subject, b"{}", timeout=0.3)
        assert sorted(seen) == ["muster.api.research.get", "muster.submit.research"]
        # It hears its team's job events, not another team's.
        heard: list[str] = []

        async def on_event(msg: Any) -> None:
            heard.append(msg.subject)

        await east.subscribe("muster.events.team.research.*", cb=on_event)
        with contextlib.suppress(Exception):
            await east.subscribe("muster.events.team.prod.*", cb=on_event)
        await flush(east)
        await broker.publish("muster.events.team.prod.j2", b"x")
        await broker.publish("muster.events.team.research.j1", b"x")
        await flush(broker)
        await wait_for(lambda: heard, what="the research team's event")
        assert heard == ["muster.events.team.research.j1"]
    finally:
        for c in server.conns:
            await c.close()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=10)
