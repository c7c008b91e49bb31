"""The real broker and one fake cluster for CLI tests that run commands end to end: queue "ml"
capped at 8 GPUs, a job that holds them, the `live` fixture, and one CliRunner."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
from typer.testing import CliRunner

from broker.embedded import EmbeddedNats
from schemas.config import FlavorQuota, QueueConfig, ResourceQuota
from tests.world import ThreadedWorld, World, flavor

runner = CliRunner()

# One cluster of two 8-GPU on-demand nodes; queue "ml" may use 8 of them.
QUEUES = [
    QueueConfig(name="default"),
    QueueConfig(
        name="ml",
        quotas=[FlavorQuota(flavor="a100-od", resources={"gpu": ResourceQuota(nominal=8)})],
    ),
]
BLOCKER = {
    "name": "blocker",
    "job_id": "blocker",
    "queue": "ml",
    "gang": [{"name": "w", "gpu": 8}],
    "workload": {"simulate": {"total_steps": 1_000_000, "steps_per_second": 10.0}},
}


async def _start(w: World) -> None:
    w.harness.config = msgspec.structs.replace(w.harness.config, queues=QUEUES)
    await w.start({"c1": [flavor("a100-od", capacity="on-demand", nodes=2)]}, start_delay_s=0.1)


@pytest.fixture
def live(fresh_nats: EmbeddedNats) -> Iterator[tuple[ThreadedWorld, World]]:
    """The real broker and one fake cluster under the default subject prefix the CLI uses,
    on a nats-server of their own."""
    threaded = ThreadedWorld(fresh_nats.url, _start)
    with threaded as world:
        yield threaded, world
