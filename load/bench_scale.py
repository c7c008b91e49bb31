"""Broker memory with 100,000 pending jobs, and recovery after `kill -9`.

    python -m load.bench_scale [--jobs 100000] [--runs 3] [--window 1000] [--lease-ttl-s 2.5]

The broker processes cache their bytecode as an installed broker does (`--compile-each-start`
keeps an environment's PYTHONDONTWRITEBYTECODE, under which every restart compiles the broker).

Jobs are submitted as clients submit them (with client job ids) while no cluster can take
them, so they all stay pending: a request each, at most `--window` unanswered at once, and the
broker answers once the job's record is stored in JetStream and the submission acknowledged.
Durable submissions/s = jobs / (last answer - first request); every answer must accept its job.
`submit_cpu_ms_per_job` is the broker's CPU (user + system) over those submissions per job:
what the broker's own work per submission costs, which the rate, shared with nats-server and
this process on the same cores, shows only through the host's noise.
The leader has a snapshot of the job bucket written once enough was written (broker/
snapshotwriter.py); the benchmark waits until one holds every record (`snapshot_wait_s`; with
`--no-records-snapshot` none is written). Then the broker is killed with SIGKILL and
restarted; we time from the restart to the broker
answering as leader with every job restored, and check that the set of job ids is exactly the
one submitted (none lost, none duplicated); `rss_restarted_mib` is the restarted broker's RSS
once it leads with them.

Then failover: a second broker process (its own state directory, so another identity) stands
by for `--standby-warmup-s` while it mirrors the job bucket; the leader is SIGKILLed and we time
until the standby answers as leader with every job restored. The standby finds the leader
dead by its dropped subscription (half a lease TTL without a renewal at most, instead of the
whole TTL: broker/liveness.py; `taken_from_dead` is 1 when it did); the standby's own
`restore_s` is what the hot standby saves against the cold restart above. Last, a clean
handover: a third broker stands by as long, the leader is stopped with SIGTERM (it deletes its
lease key as it exits) and we time until the new standby answers as leader with every job
restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
import uuid
from collections import deque
from typing import Annotated, Any

import nats
import typer
from nats.aio.client import Client

from broker.embedded import EmbeddedNats
from load.command import Count, JsonOut, Options, program, summary
from load.common import (
    BrokerProcess,
    bytecode_cached,
    emit,
    median,
    proc_cpu_s,
    raw_nats_baseline,
)
from schemas.codec import decode_submit_reply, encode_json
from schemas.config import BrokerConfig, Limits, QueueConfig, Timeouts
from schemas.subjects import REPLY_HEADER
from shell.natsio import Asked, Requester

REPLY_TIMEOUT_S = 60.0  # a submission unanswered this long fails the run
DEFAULT_WINDOW = 1000  # submissions unanswered at once: clients waiting for their answers

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


async def one_run(url: str, args: Options) -> dict[str, float]:
    jobs, queues, standby_warmup_s = args.jobs, args.queues, args.standby_warmup_s
    prefix = f"s{uuid.uuid4().hex[:8]}"
    config = BrokerConfig(
        subject_prefix=prefix,
        queues=[QueueConfig(name=f"q{i}") for i in range(queues)],
        timeouts=Timeouts(lease_ttl_s=args.lease_ttl_s),
        limits=Limits() if args.records_snapshot else Limits(records_snapshot_after_writes=0),
    )
    broker = BrokerProcess(url, config)
    broker.start()
    nc = await nats.connect(url)
    rng = random.Random(7)
    try:
        epoch = (await broker.wait_leading(nc))["epoch"]
        watching = BrokerProcess(url, config) if args.standby_during_submit else None
        if watching is not None:
            watching.start()
            await asyncio.sleep(standby_warmup_s)  # it mirrors the bucket and watches the lease
        cpu_before = cpu_seconds(broker)
        ingest_s = await submit_durably(nc, broker, jobs, queues, rng, args.window)
        submit_cpu_s = cpu_seconds(broker) - cpu_before
        await asyncio.sleep(1.0)
        rss = broker.rss_bytes()
        stats = await broker.stats(nc, timeout=10)
        if watching is not None:
            watching.cleanup()
        if stats["epoch"] != epoch:
            raise RuntimeError(
                f"false failover: the leader of epoch {epoch} lost the lease while it took the "
                f"submissions (now epoch {stats['epoch']}); lease_ttl_s {args.lease_ttl_s:g} "
                "is too short for this machine's load"
            )
        near_misses = float(stats["lease_recreated"])
        assert stats["jobs"] == jobs and stats["pending"] == jobs, stats
        snapshot_wait_s = await snapshot_written(nc, broker) if args.records_snapshot else 0.0
        broker.kill9()
        restart_at = time.perf_counter()
        broker.start()
        stats = await broker.wait_leading(nc, timeout=120)
        recovered_s = time.perf_counter() - restart_at
        recovered_cpu_s = cpu_seconds(broker)
        assert stats["restored_jobs"] == jobs and stats["jobs"] == jobs, stats
        assert bool(stats["restored_from_snapshot"]) == args.records_snapshot, stats
        await check_sample(nc, broker, jobs)
        rss_restarted = broker.rss_bytes()  # what the restore left resident
        # Failover to a hot standby.
        standby = BrokerProcess(url, config)
        standby.start()
        await asyncio.sleep(standby_warmup_s)
        standby_cpu_s = cpu_seconds(standby)  # its start and first read of every record
        broker.kill9()
        killed_at = time.perf_counter()
        takeover = await standby.wait_leading(nc, timeout=120)
        takeover_s = time.perf_counter() - killed_at
        assert takeover["restored_jobs"] == jobs and takeover["jobs"] == jobs, takeover
        await check_sample(nc, standby, jobs)
        # Handover on a clean exit: the leader (the standby above) is stopped with SIGTERM.
        handover_s, handover_restore_s = await clean_handover(
            url, config, nc, standby, jobs, standby_warmup_s
        )
        standby.cleanup()
        return {
            "rss_mib": rss / 2**20,
            "rss_restarted_mib": rss_restarted / 2**20,
            "recovered_s": recovered_s,
            "recovered_cpu_s": recovered_cpu_s,
            "restore_s": float(stats["restore_s"]),
            "takeover_s": takeover_s,
            "standby_restore_s": float(takeover["restore_s"]),
            # 1 when the standby found the killed leader by its dropped subscription, 0 when
            # it waited for the lease to expire (broker/liveness.py)
            "taken_from_dead": float(takeover.get("lease_taken_from_dead", 0)),
            "standby_warmup_cpu_s": standby_cpu_s,
            "handover_s": handover_s,
            "handover_restore_s": handover_restore_s,
            "lease_recreated": near_misses,
            "submit_rate": jobs / ingest_s,
            "submit_cpu_ms_per_job": submit_cpu_s * 1000 / jobs,
            "snapshot_wait_s": snapshot_wait_s,
        }
    finally:
        await nc.close()
        broker.cleanup()


def cpu_seconds(broker: BrokerProcess) -> float:
    """CPU seconds the broker process has used (user + system): its restart's cost in CPU,
    which other work on the machine does not inflate as it does the wall time."""
    assert broker.proc is not None
    return proc_cpu_s(broker.proc.pid)


async def submit_durably(
    nc: Client, broker: BrokerProcess, jobs: int, queues: int, rng: random.Random, window: int
) -> float:
    """Submit every job as a client does (request, answer once the record is stored in
    JetStream and the submission acknowledged), at most `window` unanswered at once; returns
    the seconds from the first request to the last answer. Every answer must accept its job."""
    requests = Requester(nc)
    await requests.start()
    inflight: deque[Asked] = deque()
    started = time.perf_counter()
    for i in range(jobs):
        if len(inflight) >= window:
            await accepted(requests, inflight.popleft())
        subject = broker.subjects.submit(f"q{i % queues}")
        inflight.append(await requests.ask(subject, job(i, rng), reply_header=REPLY_HEADER))
    while inflight:
        await accepted(requests, inflight.popleft())
    return time.perf_counter() - started


async def accepted(requests: Requester, asked: Asked) -> None:
    try:
        async with asyncio.timeout(REPLY_TIMEOUT_S):
            reply = decode_submit_reply((await asked.reply).data)
    finally:
        requests.forget(asked)
    assert reply.accepted and not reply.duplicate, reply


async def clean_handover(
    url: str, config: BrokerConfig, nc: Client, leader: BrokerProcess, jobs: int, warmup_s: float
) -> tuple[float, float]:
    """Seconds from SIGTERM to the leader until a warm standby leads with every job, and the
    standby's own restore time."""
    standby = BrokerProcess(url, config)
    standby.start()
    try:
        await asyncio.sleep(warmup_s)  # it mirrors the job bucket and watches the lease
        epoch = (await leader.stats(nc, timeout=10))["epoch"]
        assert leader.proc is not None
        stopped_at = time.perf_counter()
        leader.proc.send_signal(signal.SIGTERM)
        took = await answer_with_newer_epoch(nc, standby, epoch, timeout=120)
        handover_s = time.perf_counter() - stopped_at
        leader.stop()
        assert took["restored_jobs"] == jobs and took["jobs"] == jobs, took
        await check_sample(nc, standby, jobs)
        return handover_s, float(took["restore_s"])
    finally:
        standby.cleanup()


async def answer_with_newer_epoch(
    nc: Client, broker: BrokerProcess, epoch: int, timeout: float
) -> dict[str, Any]:
    """The first stats answer from a leader newer than `epoch`, asked every 10 ms with a
    short timeout (the stopping leader answers until it has stopped serving, and a
    subscription that no longer answers costs a whole timeout)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        with contextlib.suppress(Exception):
            took = await broker.stats(nc, timeout=0.1)
            if took["epoch"] > epoch:
                return took
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no leader newer than epoch {epoch} within {timeout:g}s")


async def snapshot_written(nc: Client, broker: BrokerProcess, limit_s: float = 300.0) -> float:
    """Wait until the leader has had a snapshot of every record written (its writer runs at
    most once every `records_snapshot_gap_s`, broker/snapshotwriter.py); the seconds waited."""
    started = time.perf_counter()
    last = (await nc.jetstream().stream_info(f"KV_{broker.subjects.jobs_bucket}")).state.last_seq
    while time.perf_counter() - started < limit_s:
        if (await broker.stats(nc, timeout=10))["snapshot_seq"] >= last:
            return time.perf_counter() - started
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no snapshot of the job records up to sequence {last} in {limit_s:g}s")


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
            runs.append(await one_run(server.url, args))
            print("  run:", {k: round(v, 3) for k, v in runs[-1].items()})
    result = {
        "figure": "broker memory and restart",
        "jobs": args.jobs,
        "lease_ttl_s": args.lease_ttl_s,
        "standby_during_submit": args.standby_during_submit,
        "records_snapshot": args.records_snapshot,
        "rss_mib_median": round(median([r["rss_mib"] for r in runs]), 1),
        "rss_restarted_mib_median": round(median([r["rss_restarted_mib"] for r in runs]), 1),
        "restart_to_leading_s_median": round(median([r["recovered_s"] for r in runs]), 3),
        "restore_s_median": round(median([r["restore_s"] for r in runs]), 3),
        "restart_cpu_s_median": round(median([r["recovered_cpu_s"] for r in runs]), 3),
        "takeover_s_median": round(median([r["takeover_s"] for r in runs]), 3),
        "standby_restore_s_median": round(median([r["standby_restore_s"] for r in runs]), 3),
        "handover_s_median": round(median([r["handover_s"] for r in runs]), 3),
        "durable_submits_per_s_median": round(median([r["submit_rate"] for r in runs])),
        "submit_cpu_ms_per_job_median": round(
            median([r["submit_cpu_ms_per_job"] for r in runs]), 4
        ),
        "raw_nats_msgs_per_s": round(baseline),
        "runs": runs,
        "targets": {"rss_mib": 1024, "restart_s": 5},
    }
    print(
        f"scale: {args.jobs:,} pending jobs, RSS {result['rss_mib_median']} MiB "
        f"({result['rss_restarted_mib_median']} MiB after the restart); restart to "
        f"leading {result['restart_to_leading_s_median']} s (restore "
        f"{result['restore_s_median']} s, {result['restart_cpu_s_median']} CPU-s); standby "
        f"takeover {result['takeover_s_median']} s "
        f"(restore {result['standby_restore_s_median']} s); clean handover "
        f"{result['handover_s_median']} s; durable submits "
        f"{result['durable_submits_per_s_median']:,}/s "
        f"({result['submit_cpu_ms_per_job_median']} ms of broker CPU each)"
    )
    return result


app = program()


@app.command(help=summary(__doc__))
def bench_scale(
    jobs: Count = 100_000,
    queues: Count = 100,
    runs: Count = 3,
    standby_warmup_s: Annotated[float, typer.Option(min=0.0)] = 10.0,
    window: Annotated[int, typer.Option(min=1, max=100_000)] = DEFAULT_WINDOW,
    lease_ttl_s: Annotated[float, typer.Option(min=1.0)] = Timeouts().lease_ttl_s,
    standby_during_submit: Annotated[
        bool,
        typer.Option(
            "--standby-during-submit",
            help="a standby watches the lease while the jobs are submitted; a leader that "
            "loses the lease meanwhile (a false failover) fails the run",
        ),
    ] = False,
    records_snapshot: Annotated[
        bool,
        typer.Option(
            "--records-snapshot/--no-records-snapshot",
            help="before the kill, wait until the leader has had a snapshot of every record "
            "written, so that the restart reads it (the default); without, no snapshot is "
            "written and the restart reads every record",
        ),
    ] = True,
    compile_each_start: Annotated[
        bool,
        typer.Option(
            "--compile-each-start",
            help="keep this environment's bytecode setting for the brokers (with "
            "PYTHONDONTWRITEBYTECODE set, each start compiles the broker from source)",
        ),
    ] = False,
    json_out: JsonOut = None,
) -> None:
    options = Options(
        jobs=jobs,
        queues=queues,
        runs=runs,
        standby_warmup_s=standby_warmup_s,
        window=window,
        lease_ttl_s=lease_ttl_s,
        standby_during_submit=standby_during_submit,
        records_snapshot=records_snapshot,
    )
    with bytecode_cached(not compile_each_start):
        emit(asyncio.run(main_async(options)), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_scale")
