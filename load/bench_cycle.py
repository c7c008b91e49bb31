"""Admission-cycle time of the lifecycle machine against queue depth.

    python -m load.bench_cycle [--depths 1000,10000,100000] [--runs 7] [--json out.json]

A fleet of 4 clusters x 50 nodes x 8 GPUs is filled with running 8-GPU jobs, then `depth`
more jobs of Philly gang sizes queue behind them (three queues). Each timed cycle follows a
capacity change (one node re-reported), so the machine reconsiders the heads of every queue
(`Backlog.lookahead` per queue) and finds nothing fits. That is the steady state of a deep
backlog on a full fleet. The cycle time should not grow with the depth: only the heads are
examined. Prints the median and spread per depth, and one `RESULT {...}` line.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from broker.core.effects import split_reply
from broker.core.inputs import CYCLE, AgentBatch, SubmitJob
from broker.core.machine import Machine
from load.command import JsonOut, Options, program, summary
from load.common import emit
from load.traces import gang_shape
from schemas.agent import ClusterSnapshot, EventBatch, FlavorInfo, NodeInfo, NodeUpsert
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CheckpointSpec, JobSpec, PodSet

CLUSTERS = 4
NODES = 50
GPUS = 8
QUEUES = ("research", "production", "dev")
SIZES = [1] * 93 + [2, 2, 4, 4, 8, 8, 16]  # Philly's mix: 93 % single-GPU jobs


def _node(cluster: str, i: int) -> NodeInfo:
    flavor = "spot" if i % 2 else "od"
    return NodeInfo(
        name=f"{cluster}-n{i:03d}", flavor=flavor, gpu=GPUS, cpu_milli=96_000, memory=2**40
    )


def _spec(i: int, gpus: int, queue: str) -> JobSpec:
    replicas, per = gang_shape(gpus)
    return JobSpec(
        name=f"j{i}",
        job_id=f"j{i}",
        queue=queue,
        gang=[PodSet(name="worker", replicas=replicas, gpu=per, cpu="4", memory="16Gi")],
        capacity="any",
        # Checkpointed, so spot nodes take them too (a job without one stays off spot).
        checkpoint=CheckpointSpec(uri=f"s3://ckpt/j{i}"),
    )


def fill(m: Machine, now: float, queues: Sequence[str]) -> int:
    """The fleet reports, and 8-GPU jobs of `queues` fill it; returns the next job number."""
    flavors = [
        FlavorInfo(name="od", capacity_type="on-demand", gpu_type="a100", price_per_gpu_hour=4.1),
        FlavorInfo(name="spot", capacity_type="spot", gpu_type="a100", price_per_gpu_hour=1.5),
    ]
    for c in range(CLUSTERS):
        name = f"c{c}"
        snap = ClusterSnapshot(flavors=flavors, nodes=[_node(name, i) for i in range(NODES)])
        m.handle(
            AgentBatch(name, EventBatch(cluster=name, instance="i", seq=1, events=[snap])), now
        )
    i = 0
    for _ in range(CLUSTERS * NODES):
        split_reply(m.handle(SubmitJob(_spec(i, GPUS, queues[i % len(queues)])), now))
        i += 1
    m.handle(CYCLE, now)
    return i


def build(depth: int, seed: int) -> tuple[Machine, float]:
    """A full fleet and `depth` queued jobs; returns the machine and the virtual time."""
    m = Machine(BrokerConfig(queues=[QueueConfig(name=q) for q in QUEUES]))
    now = 1_700_000_000.0
    i = fill(m, now, QUEUES)
    rng = random.Random(seed)
    for _ in range(depth):
        split_reply(m.handle(SubmitJob(_spec(i, rng.choice(SIZES), QUEUES[i % 3])), now))
        i += 1
    m.handle(CYCLE, now)  # the fresh jobs get their first look (and are parked)
    return m, now


def time_cycles(m: Machine, now: float, cycles: int) -> list[tuple[float, float]]:
    """(wall, this process's CPU) seconds of each cycle: CPU time is the one-core figure
    when other work shares the machine."""
    out = []
    seq = 1
    for k in range(cycles):
        now += 1.0
        seq += 1
        node = _node("c0", k % NODES)
        batch = EventBatch(cluster="c0", instance="i", seq=seq, events=[NodeUpsert(node=node)])
        m.handle(AgentBatch("c0", batch), now)
        assert m.wants_cycle
        t0, c0 = time.perf_counter(), time.process_time()
        effects = m.handle(CYCLE, now)
        out.append((time.perf_counter() - t0, time.process_time() - c0))
        assert not effects, "the fleet is full: nothing may be admitted"
    return out


app = program()


@app.command(help=summary(__doc__))
def bench_cycle(
    depths: Annotated[
        str, typer.Option(help="queued jobs per measurement, comma-separated")
    ] = "1000,10000,100000",
    runs: Annotated[int, typer.Option(min=1, help="timed cycles per depth")] = 7,
    seed: int = 1,
    json_out: JsonOut = None,
) -> None:
    try:
        sizes = [int(d) for d in depths.split(",") if d.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"{depths!r}: give whole numbers separated by commas, e.g. 1000,10000",
            param_hint="--depths",
        ) from None
    if not sizes or any(not 1 <= d <= 1_000_000 for d in sizes):
        raise typer.BadParameter("each depth must be 1..1,000,000", param_hint="--depths")
    run_bench(Options(depths=sizes, runs=runs, seed=seed, json=json_out))


def run_bench(args: Options) -> dict[str, Any]:
    depths: list[int] = args.depths
    result: dict[str, Any] = {"bench": "cycle", "runs": args.runs, "depths": {}}
    print(
        f"cycle bench: {CLUSTERS} clusters x {NODES} nodes x {GPUS} GPUs, full; "
        f"{len(QUEUES)} queues; cycle after one node update, {args.runs} cycles per depth"
    )
    for depth in depths:
        t0 = time.perf_counter()
        m, now = build(depth, args.seed)
        setup = time.perf_counter() - t0
        assert m.views.pending_count() == depth, (m.views.pending_count(), depth)
        pairs = time_cycles(m, now, args.runs)
        times = [w for w, _ in pairs]
        cpu = [c for _, c in pairs]
        med = statistics.median(times)
        print(
            f"{depth:>7,} queued: cycle median {med * 1e3:7.2f} ms wall, "
            f"{statistics.median(cpu) * 1e3:7.2f} ms CPU "
            f"(wall min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}; setup {setup:.1f} s)"
        )
        result["depths"][str(depth)] = {
            "median_ms": round(med * 1e3, 3),
            "median_cpu_ms": round(statistics.median(cpu) * 1e3, 3),
            "min_ms": round(min(times) * 1e3, 3),
            "max_ms": round(max(times) * 1e3, 3),
        }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app(prog_name="python -m load.bench_cycle")
