"""Each attack uses the intruder's real credentials against a real nats-server running the
generated authorization, and must be refused with nothing delivered."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from typer.testing import CliRunner

from broker.cli_operator import app
from broker.embedded import nats_server_binary
from broker.liveness import Alive, LivenessAnswer
from broker.natsconfig import load_broker_config, render
from schemas.subjects import Subjects
from shell.natsio import flush
from tests.security.conftest import CLUSTERS, CONFIG, AuthNats, passwords, users_in
from tests.support import DEPLOY


async def _settled(*conns: Any) -> None:
    """Every connection's commands have reached the server and been answered."""
    for c in conns:
        await flush(c)


def _violations(server: AuthNats, user: str) -> list[str]:
    return [str(e) for e in server.errors.get(user, [])]


def test_generated_config_passes_nats_server_check(tmp_path: Path) -> None:
    conf = render(CONFIG, CLUSTERS)
    (tmp_path / "accounts.conf").write_text(conf)
    (tmp_path / "nats.conf").write_text("listen: 127.0.0.1:4222\ninclude ./accounts.conf\n")
    res = subprocess.run(
        [nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"],
        env={**os.environ, **passwords(conf)},
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert users_in(conf) == [
        "broker",
        "admin",
        "agent-east",
        "agent-west",
        "team-alpha",
        "team-beta",
        "workload",
    ]


def test_deploy_ships_what_the_generator_prints() -> None:
    configmap = DEPLOY / "broker" / "configmap.yaml"
    loaded = load_broker_config(configmap)
    shipped = configmap.parents[1] / "nats" / "accounts.conf"
    assert shipped.read_text() == render(loaded.config, ["east", "west"], loaded.aliases), (
        "deploy/nats/accounts.conf is stale: run `make nats-config` and commit it"
    )


def test_cli_prints_the_same_config(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(
        "queues:\n  - {name: vision, team: alpha}\n  - {name: speech, team: beta}\n"
        "  - {name: ops}\nqueue_aliases: {vision-batch: vision}\n"
    )
    args = ["nats-config", str(cfg), "--cluster", "west", "--cluster", "east"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert res.output == render(CONFIG, CLUSTERS)


async def test_team_submits_only_to_its_own_queues(auth_nats: AuthNats) -> None:
    broker = await auth_nats.connect("broker")
    alpha = await auth_nats.connect("team-alpha")
    seen: list[str] = []

    async def record(msg: Any) -> None:
        seen.append(msg.subject)

    await broker.subscribe("muster.submit.*", cb=record)
    await _settled(broker)
    for queue in ("speech", "ops", "vision", "vision-batch"):
        await alpha.publish(f"muster.submit.{queue}", b"{}")
    await _settled(alpha, broker)
    await _settled(broker)
    assert sorted(seen) == ["muster.submit.vision", "muster.submit.vision-batch"]
    refused = _violations(auth_nats, "team-alpha")
    assert any("muster.submit.speech" in e for e in refused)
    assert any("muster.submit.ops" in e for e in refused)


async def test_team_cannot_read_another_teams_replies_events_or_specs(
    auth_nats: AuthNats,
) -> None:
    broker = await auth_nats.connect("broker")
    alpha = await auth_nats.connect("team-alpha")
    beta = await auth_nats.connect("team-beta")
    stolen: list[str] = []

    async def steal(msg: Any) -> None:
        stolen.append(msg.subject)

    for subject in (
        "_INBOX.>",
        "_INBOX_team-beta.>",
        "_INBOX_broker.>",
        "muster.events.job.*",
        "muster.events.team.beta.*",
        "muster.submit.speech",
        "$JS.API.>",
        ">",
    ):
        await alpha.subscribe(subject, cb=steal)
    await _settled(alpha)

    async def answer(msg: Any) -> None:
        await msg.respond(b'{"ok": true, "result": "beta-secret"}')

    await broker.subscribe("muster.api.beta.*", cb=answer)
    # The broker's own JetStream deliveries come to its private inbox.
    js = broker.jetstream()
    await js.add_stream(name="MUSTER_SUBMIT", subjects=["muster.submit.*"])
    await _settled(broker)
    reply = await beta.request("muster.api.beta.get", b"{}", timeout=5)
    assert reply.subject.startswith("_INBOX_team-beta.")
    await broker.publish("muster.events.team.beta.job-1", b"{}")
    await broker.publish("muster.events.job.job-1", b"{}")
    await beta.publish("muster.submit.speech", b'{"env": {"TOKEN": "x"}}')
    sub = await js.pull_subscribe("muster.submit.*", durable="submit")
    (spec,) = await sub.fetch(1, timeout=5)
    assert spec.data == b'{"env": {"TOKEN": "x"}}'
    await _settled(beta, broker, alpha)
    assert stolen == []
    assert len(_violations(auth_nats, "team-alpha")) == 8  # every subscription refused


async def test_team_calls_the_api_only_under_its_own_name(auth_nats: AuthNats) -> None:
    broker = await auth_nats.connect("broker")
    alpha = await auth_nats.connect("team-alpha")
    heard: list[str] = []

    async def answer(msg: Any) -> None:
        heard.append(msg.subject)
        await msg.respond(b"{}")

    await broker.subscribe("muster.api.*.*", cb=answer)
    await _settled(broker)
    await alpha.request("muster.api.alpha.cancel", b"{}", timeout=5)
    for subject in ("muster.api.beta.cancel", "muster.api.cancel", "muster.api.admin.cancel"):
        with pytest.raises((NatsTimeout, NoRespondersError)):
            await alpha.request(subject, b"{}", timeout=0.3)
    assert heard == ["muster.api.alpha.cancel"]


async def test_inbox_prefix_is_enforced(auth_nats: AuthNats) -> None:
    """A client that connects with the shared default prefix hears no replies at all."""
    broker = await auth_nats.connect("broker")
    alpha = await auth_nats.connect("team-alpha", prefix="_INBOX")

    async def answer(msg: Any) -> None:
        await msg.respond(b"{}")

    await broker.subscribe("muster.api.alpha.*", cb=answer)
    await _settled(broker)
    with pytest.raises((NatsTimeout, NoRespondersError)):
        await alpha.request("muster.api.alpha.get", b"{}", timeout=0.5)


async def test_agent_speaks_only_for_its_cluster(auth_nats: AuthNats) -> None:
    broker = await auth_nats.connect("broker")
    east = await auth_nats.connect("agent-east")
    at_broker: list[str] = []
    at_east: list[str] = []

    async def to_broker(msg: Any) -> None:
        at_broker.append(msg.subject)

    async def to_east(msg: Any) -> None:
        at_east.append(msg.subject)

    await broker.subscribe("muster.agent.*.events", cb=to_broker)
    await broker.subscribe("muster.submit.*", cb=to_broker)
    await broker.subscribe("muster.checkpoint.*", cb=to_broker)
    await _settled(broker)
    await east.subscribe("muster.agent.west.cmd", cb=to_east)
    await east.subscribe("muster.events.job.*", cb=to_east)
    await east.publish("muster.agent.west.events", b"spoof")
    await east.publish("muster.submit.vision", b"{}")
    await east.publish("muster.checkpoint.job-1", b"{}")
    await east.publish("muster.agent.east.events", b"ok")
    await _settled(east, broker)
    await broker.publish("muster.agent.west.cmd", b"dispatch")
    await broker.publish("muster.events.job.job-1", b"{}")
    await _settled(broker, east)
    await _settled(broker)
    assert at_broker == ["muster.agent.east.events"]
    assert at_east == []


async def test_only_brokers_probe_and_answer_on_the_liveness_subject(auth_nats: AuthNats) -> None:
    """A standby's probe reaches the leader and its answer comes back; the admin can neither
    answer for a leader (it would keep a dead one looking alive) nor probe."""
    alive = Subjects(prefix=CONFIG.subject_prefix).lease_alive
    leader = await auth_nats.connect("broker")
    standby = await auth_nats.connect("broker")
    admin = await auth_nats.connect("admin")
    impostor: list[str] = []

    async def hear(msg: Any) -> None:
        impostor.append(msg.subject)
        await msg.respond(b"{}")

    await admin.subscribe(alive, cb=hear)
    await _settled(admin)
    with pytest.raises(NoRespondersError):
        await standby.request(alive, b"", timeout=2)
    answer = LivenessAnswer(leader, alive, lambda: Alive(holder="leader", epoch=7))
    await answer.start()
    await _settled(leader)
    reply = await standby.request(alive, b"", timeout=2)
    assert msgspec.json.decode(reply.data, type=Alive) == Alive(holder="leader", epoch=7)
    await admin.publish(alive, b"")
    await _settled(admin)
    assert not impostor
    refused = _violations(auth_nats, "admin")  # nats-py lowercases the server's message
    assert any(f'subscription to "{alive.lower()}"' in e for e in refused)
    assert any(f'publish to "{alive.lower()}"' in e for e in refused)
