"""Broker memory with 100,000 pending jobs, and recovery after `kill -9`.

    python -m load.bench_scale [--jobs 100000] [--runs 3]

Jobs are published to the submission subject (with client job ids) while no cluster can take
them, so they all stay pending. Then the broker is killed with SIGKILL and restarted; we time
from the restart to the broker answering as leader with every job restored, and check that the
set of job ids is exactly the one submitted (none lost, none duplicated).

Then failover: a second broker process (its own state directory, so another identity) stands
by for `--standby-warmup-s` while it mirrors the job bucket; the leader is SIGKILLed and we time
until the standby answers as leader with every job restored. That time is mostly the lease
running out (`timeouts.lease_ttl_s`, 5 s); the standby's own `restore_s` is what the hot
standby saves against the cold restart above.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Annotated

import nats
import typer
from nats.aio.client import Client

from broker.embedded import EmbeddedNats
from load.command import Count, JsonOut, Options, program, summary
from load.common import BrokerProcess, emit, median, raw_nats_baseline
from schemas.codec import encode_json
from schemas.config import BrokerConfig, QueueConfig
from shell.natsio import flush

GANGS = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 16]


def job(i: int, rng: random.Random) -> bytes:
    gpus = rng.choice(GANGS)
    replicas, per = (1, gpus) if gpus <= 8 else (gpus // 8, 8)
    return encode_json(
        {
            "name": "bench",
            "job_id": f"job-{i}",
            "priority": rng.randint(0, 3),
            "gang": [
                {"name": "worker", "replicas": replicas, "gpu": per, "cpu": "8", "memory": "64Gi"}
            ],
            "capacity": rng.choice(["spot", "on-demand", "spot-then-on-demand", "any"]),
            "checkpoint": {"uri": f"s3://ckpt/job-{i}"},
        }
    )


async def one_run(url: str, jobs: int, queues: int, standby_warmup_s: float) -> dict[str, float]:
    prefix = f"s{uuid.uuid4().hex[:8]}"
    config = BrokerConfig(
        subject_prefix=prefix, queues=[QueueConfig(name=f"q{i}") for i in range(queues)]
    )
    broker = BrokerProcess(url, config)
    broker.start()
    nc = await nats.connect(url)
    rng = random.Random(7)
    try:
        await broker.wait_leading(nc)
        started = time.perf_counter()
        for i in range(jobs):
            await nc.publish(broker.subjects.submit(f"q{i % queues}"), job(i, rng))
            if i % 2000 == 0:
                await flush(nc)
        await flush(nc)
        while (await broker.stats(nc, timeout=10))["jobs"] < jobs:
            await asyncio.sleep(0.1)
        ingest_s = time.perf_counter() - started
        await asyncio.sleep(1.0)
        rss = broker.rss_bytes()
        stats = await broker.stats(nc, timeout=10)
        assert stats["jobs"] == jobs and stats["pending"] == jobs, stats
        broker.kill9()
        restart_at = time.perf_counter()
        broker.start()
        stats = await broker.wait_leading(nc, timeout=120)
        recovered_s = time.perf_counter() - restart_at
        assert stats["restored_jobs"] == jobs and stats["jobs"] == jobs, stats
        await check_sample(nc, broker, jobs)
        # Failover to a hot standby.
        standby = BrokerProcess(url, config)
        standby.start()
        await asyncio.sleep(standby_warmup_s)
        broker.kill9()
        killed_at = time.perf_counter()
        takeover = await standby.wait_leading(nc, timeout=120)
        takeover_s = time.perf_counter() - killed_at
        assert takeover["restored_jobs"] == jobs and takeover["jobs"] == jobs, takeover
        await check_sample(nc, standby, jobs)
        standby.cleanup()
        return {
            "rss_mib": rss / 2**20,
            "recovered_s": recovered_s,
            "restore_s": float(stats["restore_s"]),
            "takeover_s": takeover_s,
            "standby_restore_s": float(takeover["restore_s"]),
            "submit_rate": jobs / ingest_s,
        }
    finally:
        await nc.close()
        broker.cleanup()


async def check_sample(nc: Client, broker: BrokerProcess, jobs: int) -> None:
    """200 sampled jobs answer from the leader, present and still queued."""
    for i in random.Random(1).sample(range(jobs), 200):
        msg = await nc.request(
            broker.subjects.api("get"), encode_json({"job_id": f"job-{i}"}), timeout=10
        )
        view = json.loads(msg.data)
        assert view["ok"] and view["result"]["state"] == "queued", view


async def main_async(args: Options) -> dict[str, object]:
    async with EmbeddedNats() as server:
        baseline = await raw_nats_baseline(server.url)
        runs = []
        for _ in range(args.runs):
            runs.append(await one_run(server.url, args.jobs, args.queues, args.standby_warmup_s))
            print("  run:", {k: round(v, 3) for k, v in runs[-1].items()})
    result = {
        "figure": "broker memory and restart",
        "jobs": args.jobs,
        "rss_mib_median": round(median([r["rss_mib"] for r in runs]), 1),
        "restart_to_leading_s_median": round(median([r["recovered_s"] for r in runs]), 3),
        "restore_s_median": round(median([r["restore_s"] for r in runs]), 3),
        "takeover_s_median": round(median([r["takeover_s"] for r in runs]), 3),
        "standby_restore_s_median": round(median([r["standby_restore_s"] for r in runs]), 3),
        "durable_submits_per_s_median": round(median([r["submit_rate"] for r in runs])),
        "raw_nats_msgs_per_s": round(baseline),
        "runs": runs,
        "targets": {"rss_mib": 1024, "restart_s": 5},
    }
    print(
        f"scale: {args.jobs:,} pending jobs, RSS {result['rss_mib_median']} MiB; restart to "
        f"leading {result['restart_to_leading_s_median']} s (restore "
        f"{result['restore_s_median']} s); standby takeover {result['takeover_s_median']} s "
        f"(restore {result['standby_restore_s_median']} s); durable submits "
        f"{result['durable_submits_per_s_median']:,}/s"
    )
    return result


app = program()


@app.command(help=summary(__doc__))
def bench_scale(
    jobs: Count = 100_000,
    queues: Count = 100,
    runs: Count = 3,
    standby_warmup_s: Annotated[float, typer.Option(min=0.0)] = 10.0,
    json_out: JsonOut = None,
) -> None:
    options = Options(jobs=jobs, queues=queues, runs=runs, standby_warmup_s=standby_warmup_s)
    emit(asyncio.run(main_async(options)), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_scale")
