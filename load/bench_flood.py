"""Another queue's submission latency while one queue takes a flood.

    python -m load.bench_flood [--jobs 50000] [--probes 20] [--runs 3]

An in-process broker on an embedded nats-server (no clusters, so every job stays queued) gets
`--jobs` submissions published at once to queue `flood`; then, while it works through them,
`--probes` submissions to queue `other` are sent one after another, each timed from request to
the broker's answer. Reported per run: the probes' median and max latency, how many probes
were answered before the flood had drained, and the flood's drain time; then the median over
runs. The loader shares the broker's event loop, so latencies include that contention.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Annotated

import nats
import typer

from broker.embedded import EmbeddedNats
from broker.service import Broker
from load.bench_scale import job
from load.command import JsonOut, Options, program, summary
from load.common import emit, median
from schemas.codec import encode_json
from schemas.config import BrokerConfig, Limits, QueueConfig, Timeouts
from shell.logs import configure_logging
from shell.natsio import submit_request

RUN_LIMIT_S = 600.0


async def one_run(args: Options, seed: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(store_dir=Path(tmp) / "nats")
        await server.start()
        nc = await nats.connect(server.url)
        bnc = await nats.connect(server.url)
        config = BrokerConfig(
            queues=[QueueConfig(name="flood"), QueueConfig(name="other")],
            timeouts=Timeouts(lease_ttl_s=60.0),
            limits=Limits(max_pending_per_queue=1_000_000),
        )
        broker = Broker(config, bnc, pace_gc=True)
        task = asyncio.create_task(broker.run())
        try:
            await asyncio.wait_for(broker.leading.wait(), 30)
            rng = random.Random(seed)
            started = time.monotonic()
            for i in range(args.jobs):
                await nc.publish("muster.submit.flood", job(i, rng))
                if i % 5000 == 4999:
                    await nc.flush()
            await nc.flush()
            latencies: list[float] = []
            before_drain = 0
            for p in range(args.probes):
                spec = {
                    "name": "probe",
                    "job_id": f"probe-{seed}-{p}",
                    "gang": [{"name": "w", "gpu": 1}],
                }
                t0 = time.perf_counter()
                reply = await submit_request(nc, "muster.submit.other", encode_json(spec), 120)
                latencies.append(time.perf_counter() - t0)
                assert b'"accepted":true' in reply.data, reply.data
                if broker.stats["submitted"] < args.jobs + p + 1:
                    before_drain += 1
            while broker.stats["submitted"] < args.jobs + args.probes:
                if time.monotonic() - started > RUN_LIMIT_S:
                    raise SystemExit(f"the flood did not drain within {RUN_LIMIT_S:g} s")
                await asyncio.sleep(0.1)
            return {
                "median_ms": 1000 * median(latencies),
                "max_ms": 1000 * max(latencies),
                "probes_before_drain": before_drain,
                "drain_s": time.monotonic() - started,
            }
        finally:
            await broker.stop()
            await asyncio.wait_for(task, 30)
            await bnc.close()
            await nc.close()
            await server.stop()


async def main_async(args: Options) -> dict[str, object]:
    runs = [await one_run(args, seed) for seed in range(args.runs)]
    return {
        "jobs": args.jobs,
        "probes": args.probes,
        "runs": [{k: round(v, 1) for k, v in r.items()} for r in runs],
        "other_queue_median_ms": round(median([r["median_ms"] for r in runs]), 1),
        "other_queue_max_ms": round(max(r["max_ms"] for r in runs), 1),
        "flood_drain_s": round(median([r["drain_s"] for r in runs]), 1),
    }


app = program()


@app.command(help=summary(__doc__))
def bench_flood(
    jobs: Annotated[int, typer.Option(min=1, max=1_000_000, help="the flood's size")] = 50_000,
    probes: Annotated[int, typer.Option(min=1, max=1000, help="other-queue jobs timed")] = 20,
    runs: Annotated[int, typer.Option(min=1, max=20)] = 3,
    json_out: JsonOut = None,
) -> None:
    configure_logging("warning")
    emit(asyncio.run(main_async(Options(jobs=jobs, probes=probes, runs=runs))), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_flood")
