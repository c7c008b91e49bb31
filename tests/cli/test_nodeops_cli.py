"""`muster cordon|uncordon|drain|notice` through the real command, against a real broker and
fake cluster on a real nats-server: what it prints, its exit codes, and its refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from broker.embedded import EmbeddedNats
from muster.cli import app
from tests.world import ThreadedWorld, World, flavor

runner = CliRunner()
NODE = "c1-a100-od-0"


async def _start(w: World) -> None:
    await w.start({"c1": [flavor("a100-od", capacity="on-demand", nodes=1)]})


@pytest.fixture
def live(fresh_nats: EmbeddedNats) -> Iterator[World]:
    with ThreadedWorld(fresh_nats.url, _start) as world:
        yield world


def test_node_commands_print_what_the_agent_did_and_refuse_with_reasons(live: World) -> None:
    url = live.harness.url
    assert live.fleet is not None
    cluster = live.fleet["c1"]

    def cli(*args: str) -> Any:
        return runner.invoke(app, [*args, "--nats", url])

    bulk = cli("cordon", "c1")
    assert bulk.exit_code == 2
    assert "name a NODE, or pass --all to cordon every node of cluster c1" in bulk.stderr
    assert not (info := cluster.node_info(NODE)) or not info.no_new_pods

    done = cli("cordon", "c1", NODE, "--reason", "disk check")
    assert done.exit_code == 0, done.stderr
    assert done.stdout.strip() == f"cordoned 1 node(s) of cluster c1: {NODE}"
    info = cluster.node_info(NODE)
    assert info is not None and info.note == "cordoned by an operator: disk check"

    every = cli("uncordon", "c1", "--all", "--json")
    assert every.exit_code == 0, every.stderr
    assert json.loads(every.stdout) == {"ok": True, "op": "uncordon", "nodes": [NODE]}

    drained = cli("drain", "c1", NODE)
    assert drained.exit_code == 0, drained.stderr
    assert drained.stdout.strip().endswith("; nothing was running there")

    gone = cli("drain", "nowhere", NODE, "--timeout", "2")
    assert gone.exit_code == 1 and "no agent of cluster 'nowhere' answers" in gone.stderr
    typo = cli("uncordon", "c1", "c1-a100-od-9")
    assert typo.exit_code == 1 and f"has no node 'c1-a100-od-9'; its nodes: {NODE}" in typo.stderr
    od = cli("notice", "c1", NODE)
    assert od.exit_code == 1 and "is on-demand capacity; only spot nodes" in od.stderr
    team = cli("cordon", "c1", NODE, "--team", "alpha")
    assert team.exit_code == 1 and "is an operator's action and team 'alpha'" in team.stderr
