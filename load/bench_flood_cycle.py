"""Admission-cycle time of the lifecycle machine while submissions flood in behind a full fleet.

    python -m load.bench_flood_cycle [--queues 100] [--depth 20000] [--batch 20]
                                     [--cycles 300] [--runs 3] [--json out.json]

The cycles of `load.bench_scale`'s durable-submission flood, without NATS: `queues` queues and
its job mix (1-16 GPUs, priorities 0-3, capacity spot, on-demand, spot-then-on-demand or any,
all checkpointed). The fleet of `load.bench_cycle` (4 clusters x 50 nodes x 8 GPUs, half spot)
is filled, `depth` jobs are queued and tried once, then each step submits `batch` new jobs and
runs one cycle: no capacity changed, so only the new jobs (and those a futile spot wait sent
back) are tried, and the parked heads of every queue stay parked. Spot-then-on-demand jobs
among the new ones make each cycle look for the earlier jobs waiting for spot (earlier.py).
Each cycle is timed by this process's CPU time (the one-core figure when the machine is
shared) and by the wall clock. Prints every run's mean per cycle, the median over runs, and
one `RESULT {...}` line.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Annotated, Any

import typer

from broker.core.effects import split_reply
from broker.core.inputs import CYCLE, SubmitJob
from broker.core.machine import Machine
from load.bench_cycle import CLUSTERS, GPUS, NODES, fill
from load.command import Count, JsonOut, Options, program, summary
from load.common import emit
from load.traces import gang_shape
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CapacityPreference, CheckpointSpec, JobSpec, PodSet

GANGS = [1] * 12 + [2, 4, 8, 16]  # load.bench_scale's mix
CAPACITIES: tuple[CapacityPreference, ...] = ("spot", "on-demand", "spot-then-on-demand", "any")
NOW = 1_700_000_000.0


def flood_spec(i: int, rng: random.Random, queues: int) -> JobSpec:
    replicas, per = gang_shape(rng.choice(GANGS))
    return JobSpec(
        name=f"f{i}",
        job_id=f"f{i}",
        queue=f"q{i % queues}",
        priority=rng.randint(0, 3),
        gang=[PodSet(name="worker", replicas=replicas, gpu=per, cpu="8", memory="64Gi")],
        capacity=rng.choice(CAPACITIES),
        checkpoint=CheckpointSpec(uri=f"s3://ckpt/f{i}"),
    )


def build(queues: int, depth: int, seed: int) -> tuple[Machine, random.Random]:
    """A full fleet and `depth` queued jobs, each tried once."""
    names = [f"q{q}" for q in range(queues)]
    m = Machine(BrokerConfig(queues=[QueueConfig(name=q) for q in names]))
    fill(m, NOW, names[:1])
    assert m.views.pending_count() == 0, "the fillers fill the fleet"
    rng = random.Random(seed)
    for i in range(depth):
        split_reply(m.handle(SubmitJob(flood_spec(i, rng, queues)), NOW))
    m.handle(CYCLE, NOW)
    return m, rng


def time_flood(
    m: Machine, rng: random.Random, queues: int, depth: int, batch: int, cycles: int
) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each cycle after `batch` new submissions."""
    out = []
    i = depth
    now = NOW
    for _ in range(cycles):
        now += 0.01
        for _ in range(batch):
            split_reply(m.handle(SubmitJob(flood_spec(i, rng, queues)), now))
            i += 1
        t0, c0 = time.perf_counter(), time.process_time()
        m.handle(CYCLE, now)
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


app = program()


@app.command(help=summary(__doc__))
def bench_flood_cycle(
    queues: Annotated[int, typer.Option(min=1, max=1000, help="queues the jobs spread over")] = 100,
    depth: Annotated[int, typer.Option(min=0, max=1_000_000, help="jobs queued before")] = 20_000,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="submissions per cycle")] = 20,
    cycles: Count = 300,
    runs: Annotated[int, typer.Option(min=1, max=50, help="runs, each on a new machine")] = 3,
    seed: int = 1,
    json_out: JsonOut = None,
) -> None:
    run_bench(
        Options(
            queues=queues,
            depth=depth,
            batch=batch,
            cycles=cycles,
            runs=runs,
            seed=seed,
            json=json_out,
        )
    )


def run_bench(args: Options) -> dict[str, Any]:
    print(
        f"flood cycle bench: {CLUSTERS} clusters x {NODES} nodes x {GPUS} GPUs, full; "
        f"{args.queues} queues, {args.depth:,} queued; {args.cycles} cycles of "
        f"{args.batch} new jobs each, {args.runs} runs"
    )
    per_run: list[dict[str, float]] = []
    for run in range(args.runs):
        m, rng = build(args.queues, args.depth, args.seed + run)
        gc.freeze()  # as the broker's GcPacer freezes what has lived a second (bench_core)
        pairs = time_flood(m, rng, args.queues, args.depth, args.batch, args.cycles)
        gc.unfreeze()
        cpu_ms = statistics.fmean(c for _, c in pairs) * 1e3
        wall_ms = statistics.fmean(w for w, _ in pairs) * 1e3
        per_run.append({"cpu_ms": round(cpu_ms, 3), "wall_ms": round(wall_ms, 3)})
        print(f"run {run + 1}: {cpu_ms:.3f} ms CPU per cycle ({wall_ms:.3f} ms wall)")
    cpu = statistics.median(r["cpu_ms"] for r in per_run)
    print(f"median: {cpu:.3f} ms CPU per cycle")
    result: dict[str, Any] = {
        "bench": "flood_cycle",
        "queues": args.queues,
        "depth": args.depth,
        "batch": args.batch,
        "cycles": args.cycles,
        "cpu_ms_per_cycle_median": round(cpu, 3),
        "runs": per_run,
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app(prog_name="python -m load.bench_flood_cycle")
