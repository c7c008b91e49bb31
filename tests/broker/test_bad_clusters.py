"""A cluster that refuses every dispatch and one that acknowledges and never runs them, beside
honest ones, through a real nats-server: their dispatch breakers open and every job finishes on
the honest clusters, long before the start timeout."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from schemas.agent import FlavorInfo
from schemas.config import SchedulingConfig
from tests.broker.conftest import Harness, broker_config
from tests.broker.wire import WireAgent


def od(price: float) -> FlavorInfo:
    return FlavorInfo(
        name="a100-od", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=price
    )


async def finish_what_runs(agent: WireAgent) -> None:
    """An honest cluster: each dispatch runs (auto_run) and then succeeds."""
    for _ in range(1000):  # bounded
        cmd = await agent.dispatches.get()
        await agent.finish(cmd.job_id, cmd.attempt)


async def test_refusing_and_swallowing_clusters_do_not_hold_jobs_that_fit_elsewhere(
    harness: Harness,
) -> None:
    config = broker_config(harness.prefix, start_s=120.0, dispatch_report_s=1.5)
    config = msgspec.structs.replace(
        config, scheduling=SchedulingConfig(breaker_failures=3, breaker_cool_down_s=300.0)
    )
    await harness.start_broker(config)
    refusing = await harness.agent("refusing", [od(0.5)], count=4)
    refusing.refuse = "admission webhook denied the request"
    swallowing = await harness.agent("swallowing", [od(0.8)], count=4)
    swallowing.auto_run = False  # acknowledges, never creates anything
    honest = [await harness.agent(name, [od(3.0)], count=2) for name in ("h1", "h2")]
    workers = [asyncio.create_task(finish_what_runs(a)) for a in honest]
    try:
        ids = []
        for i in range(12):
            reply = await harness.submit(
                {"name": f"job{i}", "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}
            )
            assert reply.accepted, reply.error
            ids.append(reply.job_id)
        for job_id in ids:
            await harness.wait_event(job_id, "succeeded", timeout=60)
        broker = harness.broker
        assert broker is not None and broker.machine is not None
        for job_id in ids:
            record = broker.machine.jobs[job_id]
            assert record.attempts[-1].cluster in ("h1", "h2"), record.attempts
        clusters = {c["name"]: c for c in (await harness.api("clusters"))["result"]}
        for name in ("refusing", "swallowing"):
            (flavor,) = clusters[name]["flavors"]
            assert flavor["breaker"] == "open", flavor
        assert "webhook denied" in clusters["refusing"]["flavors"][0]["breaker_reason"]
        assert "not reported" in clusters["swallowing"]["flavors"][0]["breaker_reason"]
        for name in ("h1", "h2"):
            assert "breaker" not in clusters[name]["flavors"][0]
        # Three different jobs opened each breaker; nothing more was sent there.
        assert refusing.dispatches.qsize() <= 4 and swallowing.dispatches.qsize() <= 4
    finally:
        for task in workers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_cluster_refusing_each_job_for_its_quota_stays_open(harness: Harness) -> None:
    """Refusals of one job alone (the team namespace's quota, `job_only`) send each job
    elsewhere at once and never open the cluster's breaker: other teams may still fit there."""
    config = broker_config(harness.prefix, start_s=120.0, dispatch_report_s=1.5)
    config = msgspec.structs.replace(
        config, scheduling=SchedulingConfig(breaker_failures=3, breaker_cool_down_s=300.0)
    )
    await harness.start_broker(config)
    full = await harness.agent("full", [od(0.5)], count=4)
    full.refuse = "namespace team-a: exceeded quota: gpu, requested: 8, used: 8, limited: 8"
    full.job_only = True
    honest = await harness.agent("h1", [od(3.0)], count=2)
    worker = asyncio.create_task(finish_what_runs(honest))
    try:
        ids = []
        for i in range(6):
            reply = await harness.submit(
                {"name": f"job{i}", "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}
            )
            assert reply.accepted, reply.error
            ids.append(reply.job_id)
        for job_id in ids:
            await harness.wait_event(job_id, "succeeded", timeout=60)
        assert full.dispatches.qsize() >= 4  # more refusals than open a breaker
        clusters = {c["name"]: c for c in (await harness.api("clusters"))["result"]}
        assert "breaker" not in clusters["full"]["flavors"][0], clusters["full"]
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
