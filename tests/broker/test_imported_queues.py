"""Imported upstream queue trees run jobs through a real broker on a real nats-server: a
Koordinator parent quota bounds its children, and a Kueue ClusterQueue admits only what it
lists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from broker.config import parse_config
from schemas.agent import Dispatch, WorkloadStatus
from schemas.config import BrokerConfig
from tests.broker.conftest import Harness
from tests.broker.wire import next_item
from tests.support import wait_for

QUEUES = Path(__file__).resolve().parents[1] / "cli" / "fixtures" / "queues"


def imported(harness: Harness, *files: str) -> BrokerConfig:
    text = f"subject_prefix: {harness.prefix}\nimport: [{', '.join(files)}]\n"
    config = parse_config(text, source="broker.yaml", base_dir=QUEUES).config
    return msgspec.structs.replace(config, timeouts=harness.config.timeouts)


def cpu_job(name: str, cores: int, gpu: int = 0, memory: str = "5Mi") -> dict[str, Any]:
    podset = {"name": "w", "replicas": 1, "cpu": str(cores), "gpu": gpu, "memory": memory}
    return {"name": name, "gang": [podset]}


async def reasons(harness: Harness, job_id: str) -> str:
    """The job's pending reasons, once the broker has recorded any."""

    async def text() -> str:
        got = await harness.api("why", {"job_id": job_id})
        assert got["ok"], got
        return "; ".join(r["message"] for r in got["result"].get("reasons", []))

    return await wait_for(text, 10, what=f"pending reasons of {job_id}")


async def test_koordinator_tree_runs_leaf_jobs_within_the_parent(harness: Harness) -> None:
    await harness.start_broker(imported(harness, "koord-quota-tree.yaml"))
    agent = await harness.agent("c1", count=2)
    # The parent quota is a cohort: no queue to submit to.
    refused = await harness.submit(cpu_job("p", 1), queue="quota-parent-example")
    assert not refused.accepted and "unknown queue" in (refused.error or "")
    # quota-example holds 5 cores (and 10Mi) of its own and borrows its sibling's: 8 fit.
    first = await harness.submit(cpu_job("a", 8), queue="quota-example")
    assert first.accepted
    dispatch: Dispatch = await next_item(agent.dispatches)
    assert dispatch.job_id == first.job_id
    await harness.wait_event(first.job_id, "running")
    # Koordinator lends idle cluster capacity beyond the mins, up to the parent's max of 40
    # cores for the whole tree: 4 more run at once, but not 29 more (8 + 4 + 29 > 40).
    second = await harness.submit(cpu_job("b", 4), queue="quota-example-b")
    assert second.accepted
    await harness.wait_event(second.job_id, "admitted")
    third = await harness.submit(cpu_job("c", 29), queue="quota-example-b")
    assert third.accepted
    why = await reasons(harness, third.job_id)
    assert "needs 29 cpu" in why, why
    assert "admitted" not in harness.kinds(third.job_id)
    await agent.send(WorkloadStatus(job_id=first.job_id, attempt=1, phase="succeeded"))
    await harness.wait_event(third.job_id, "admitted")


async def test_kueue_queue_admits_only_the_resources_it_lists(harness: Harness) -> None:
    await harness.start_broker(imported(harness, "kueue-single-clusterqueue.yaml"))
    agent = await harness.agent("c1", count=2)
    # LocalQueue user-queue feeds cluster-queue (9 cpu, 36Gi, no GPU listed).
    # A GPU gang: no quota of it can ever admit it, so submission refuses it at once (Kueue
    # marks such workloads inadmissible) and says which resource is missing.
    gpu_job = await harness.submit(cpu_job("g", 1, gpu=1), queue="user-queue")
    assert not gpu_job.accepted and gpu_job.error is not None
    assert "can never admit it" in gpu_job.error and "gpu" in gpu_job.error, gpu_job.error
    cpu_only = await harness.submit(cpu_job("c", 9), queue="user-queue")
    assert cpu_only.accepted
    dispatch: Dispatch = await next_item(agent.dispatches)
    assert dispatch.job_id == cpu_only.job_id
    await harness.wait_event(cpu_only.job_id, "running")
