"""Smaller CLI behaviour, through the real command against a real broker: a wrong URL scheme,
state aliases, cancelling a cancelled job, Koordinator's quota label as the queue."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from broker.embedded import EmbeddedNats
from broker.manifests import jobspec_from_manifest
from muster.cli import app
from schemas.config import QueueConfig
from tests.world import ThreadedWorld, World, flavor

from .conftest import fixture

runner = CliRunner()


def test_an_http_url_is_named_as_the_wrong_scheme() -> None:
    result = runner.invoke(app, ["queues", "--nats", "http://127.0.0.1:8080"])
    assert result.exit_code == 1
    assert "--nats http://127.0.0.1:8080: http:// is not a NATS URL; use nats://127.0.0.1:8080" in (
        result.stderr
    )
    assert "Name or service" not in result.stderr


def test_an_unknown_state_lists_the_states_before_connecting() -> None:
    result = runner.invoke(app, ["status", "--state", "sleeping", "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 2  # a usage error
    assert "Invalid value for '--state'" in result.stderr
    assert "'sleeping' is not a job state; use one of: queued, admitted" in result.stderr


def test_koordinators_quota_label_names_the_queue() -> None:
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    manifest["metadata"]["labels"] = {"quota.scheduling.koordinator.sh/name": "team-a"}
    assert jobspec_from_manifest(manifest).queue == "team-a"


async def _start(w: World) -> None:
    w.harness.config = msgspec.structs.replace(
        w.harness.config, queues=[QueueConfig(name="default"), QueueConfig(name="research")]
    )
    await w.start({"c1": [flavor("a100-od", capacity="on-demand", nodes=1)]}, start_delay_s=0.1)


@pytest.fixture
def live(fresh_nats: EmbeddedNats) -> Iterator[tuple[ThreadedWorld, World]]:
    threaded = ThreadedWorld(fresh_nats.url, _start)
    with threaded as world:
        yield threaded, world


def _job(name: str, queue: str = "default") -> str:
    body: dict[str, Any] = {
        "name": name,
        "job_id": name,
        "queue": queue,
        "gang": [{"name": "w", "gpu": 8}],
        "workload": {"simulate": {"total_steps": 1_000_000, "steps_per_second": 10.0}},
    }
    return json.dumps(body)


def test_state_aliases_and_cancelling_twice(live: tuple[ThreadedWorld, World]) -> None:
    threaded, world = live
    url = world.harness.url

    def cli(*args: str, stdin: str | None = None) -> Any:
        return runner.invoke(app, [*args, "--nats", url], input=stdin)

    assert cli("submit", "-", stdin=_job("holder")).exit_code == 0
    threaded.call(world.harness.wait_event("holder", "running"))
    assert cli("submit", "-", stdin=_job("waiter")).exit_code == 0

    result = cli("status", "--state", "pending", "-o", "json")
    assert result.exit_code == 0, result.stderr
    assert [j["job_id"] for j in json.loads(result.stdout)] == ["waiter"]

    first = cli("cancel", "waiter")
    assert first.exit_code == 0 and first.stdout.strip() == "job waiter is cancelled"
    again = cli("cancel", "waiter")
    assert again.exit_code == 0, again.stderr
    assert again.stdout.strip() == "job waiter is cancelled"


def test_muster_config_shows_the_defaults_it_applied() -> None:
    """A Volcano queue says nothing of preemption: the printout shows what Muster will do."""
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    result = runner.invoke(app, ["config", str(examples / "volcano-queues.yaml")])
    assert result.exit_code == 0, result.stderr
    assert "within_queue: LowerPriority" in result.stdout
    assert "reclaim_within_cohort: Any" in result.stdout
    assert "spot_without_checkpoint: false" in result.stdout
    assert "checkpoint_grace_s:" in result.stdout and "preemption_min_runtime_s:" in result.stdout


def test_a_queue_whose_quota_lists_no_flavor_says_it_admits_nothing() -> None:
    """An imported Kueue ClusterQueue without resourceGroups refuses every job: `muster queues`
    must not call it unlimited."""
    from rich.console import Console

    from broker.core.machine import Machine
    from broker.render import queues_table
    from schemas.config import BrokerConfig

    machine = Machine(
        BrokerConfig(queues=[QueueConfig(name="open"), QueueConfig(name="closed", quotas=[])])
    )
    console = Console(width=200, record=True, color_system=None)
    console.print(queues_table(machine.views.queue_views()))
    lines = {line.split()[0]: line.rstrip() for line in console.export_text().splitlines()[1:]}
    assert lines["open"].endswith("no quota (unlimited)")
    assert lines["closed"].endswith("no quota for any flavor: admits nothing")


def test_help_summaries_of_the_job_commands_are_whole_at_80_columns() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    commands = ("submit", "status", "cancel", "why", "queues", "clusters", "watch", "broker")
    commands += ("config", "nats-config", "schema")
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  ")}
    for name in commands:
        assert not lines[name].rstrip().endswith("..."), lines[name]


def test_a_finished_jobs_detail_says_where_its_last_attempt_ran() -> None:
    from rich.console import Console

    from broker.render import job_detail

    from .samples import NOW, sample_job

    job = msgspec.structs.replace(sample_job(state="succeeded"), cluster=None, flavor=None)
    console = Console(width=200, record=True, color_system=None)
    console.print(job_detail(job, now=NOW))
    text = console.export_text()
    last = job.attempts[-1]
    assert f"last ran on {last.cluster}/{last.flavor}" in text
    assert " on -" not in text
