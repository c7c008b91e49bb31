"""Dashboard page loads with 100,000 jobs in the broker.

    python -m load.bench_ui [--jobs 100000] [--runs 20]

An in-process broker on an embedded nats-server takes `--jobs` submissions over the submission
subject while no cluster can run them, so every job stays in memory. The dashboard then serves
job-list pages (unfiltered, filtered by queue and state, by name, deep offsets) and a job's
detail over HTTP; each is timed from request to the last byte of the reply.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Annotated

import aiohttp
import nats
import typer
from nats.aio.client import Client

from broker.embedded import EmbeddedNats
from broker.service import Broker
from broker.ui import views
from broker.ui.server import Dashboard, RateLimit
from load.bench_scale import job
from load.command import Count, JsonOut, Options, program, summary
from load.common import emit, median, percentile
from schemas.config import BrokerConfig, QueueConfig, Timeouts
from shell.logs import configure_logging

PAGES = {
    "first page": "/api/jobs?limit=50",
    "queue+state filter": "/api/jobs?queue=q1&state=queued&limit=50",
    "name filter": "/api/jobs?name=bench&offset=50000&limit=50",
    "offset 90,000": "/api/jobs?offset=90000&limit=50",
    "queues": "/api/queues",
}


async def load_jobs(nc: Client, broker: Broker, jobs: int, queues: int) -> float:
    rng = random.Random(7)
    started = time.monotonic()
    for i in range(jobs):
        await nc.publish(f"muster.submit.q{i % queues}", job(i, rng))
        if i % 5000 == 4999:
            await nc.flush()
    await nc.flush()
    deadline = time.monotonic() + 600
    while broker.machine is None or len(broker.machine.jobs) < jobs:
        if time.monotonic() > deadline:
            raise SystemExit("the broker did not take every job within 600 s")
        await asyncio.sleep(0.2)
    took = time.monotonic() - started
    # Pages are timed once the broker is idle again: the admission cycle over the new jobs
    # would otherwise be measured with them.
    while broker.machine.wants_cycle and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(2.0)
    return took


async def main_async(args: Options) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(store_dir=Path(tmp) / "nats")
        await server.start()
        nc = await nats.connect(server.url)
        bnc = await nats.connect(server.url)
        # The loader shares the broker's loop, so the lease outlasts its longest burst.
        config = BrokerConfig(
            queues=[QueueConfig(name=f"q{i}") for i in range(args.queues)],
            timeouts=Timeouts(lease_ttl_s=60.0),
        )
        broker = Broker(config, bnc, pace_gc=True)  # as the `muster broker` process runs
        task = asyncio.create_task(broker.run())
        await asyncio.wait_for(broker.leading.wait(), 30)
        dashboard = Dashboard(broker, rate=RateLimit(rate=1e6, burst=1e6))
        await dashboard.start("127.0.0.1", 0)
        try:
            load_s = await load_jobs(nc, broker, args.jobs, args.queues)
            assert broker.machine is not None
            some_job = next(iter(broker.machine.jobs))
            pages = {**PAGES, "job detail": f"/api/jobs/{some_job}"}
            result: dict[str, object] = {"jobs": args.jobs, "load_s": round(load_s, 1)}
            machine = broker.machine
            for label, query in (
                ("first page", {}),
                ("queue+state filter", {"queue": "q1", "state": "queued"}),
            ):
                times = []
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    views.jobs_page(machine, query, time.time())
                    times.append(time.perf_counter() - t0)
                result[f"{label} (in the loop)"] = {"median_ms": round(1000 * median(times), 1)}
            async with aiohttp.ClientSession() as http:
                for label, path in pages.items():
                    times = []
                    for _ in range(args.runs):
                        t0 = time.perf_counter()
                        async with http.get(dashboard.url + path) as resp:
                            assert resp.status == 200, (path, resp.status, await resp.text())
                            await resp.read()
                        times.append(time.perf_counter() - t0)
                    result[label] = {
                        "median_ms": round(1000 * median(times), 1),
                        "p95_ms": round(1000 * percentile(times, 95), 1),
                        "max_ms": round(1000 * max(times), 1),
                    }
            return result
        finally:
            await dashboard.stop()
            await broker.stop()
            await asyncio.wait_for(task, 30)
            await bnc.close()
            await nc.close()
            await server.stop()


app = program()


@app.command(help=summary(__doc__))
def bench_ui(
    jobs: Annotated[int, typer.Option(min=1, max=1_000_000)] = 100_000,
    queues: Count = 4,
    runs: Annotated[int, typer.Option(min=1, max=1000)] = 20,
    json_out: JsonOut = None,
) -> None:
    configure_logging("warning")
    emit(asyncio.run(main_async(Options(jobs=jobs, queues=queues, runs=runs))), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_ui")
