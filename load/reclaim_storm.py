"""Reclaim under the team-queue config (examples/broker.yaml with its Kueue import), no faults.

Thousands of short jobs split over the two ClusterQueues of one cohort, through the pure
broker core and model agents (load/vopr.py) with a quiet network. It counts what the agents
are told: cancels because of `reclaimed`, and the most attempts any job needed. Borrowed
capacity that a queue takes back is fine; the same job evicted again and again is the storm.

    python -m load.reclaim_storm --jobs 2000
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Annotated

import msgspec
import typer

from broker.config import load_config
from load.command import program, summary
from load.vopr import QUIET, Scenario, World
from schemas.agent import FlavorInfo, NodeInfo
from schemas.config import BrokerConfig
from schemas.job import CheckpointSpec, JobSpec, PodSet

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "broker.yaml"
GiB = 1 << 30
QUEUES = ("ml-cluster-queue", "ml-batch-queue")


def team_config(min_runtime_s: float | None = None) -> BrokerConfig:
    """examples/broker.yaml; `min_runtime_s` overrides the victims' minimum runtime."""
    config = load_config(EXAMPLE)
    if min_runtime_s is None:
        return config
    sched = msgspec.structs.replace(config.scheduling, preemption_min_runtime_s=min_runtime_s)
    return msgspec.structs.replace(config, scheduling=sched)


def team_scenario(jobs: int, seed: int = 0) -> Scenario:
    """Two clusters of T4 spot (the cohort's 24 GPUs) and A100 on-demand nodes; a burst."""
    rng = random.Random(seed)
    fleet = []
    for c in range(2):
        flavors = [
            FlavorInfo(name="t4-spot", capacity_type="spot", gpu_type="t4", price_per_gpu_hour=0.4),
            FlavorInfo(
                name="a100", capacity_type="on-demand", gpu_type="a100", price_per_gpu_hour=4.0
            ),
        ]
        nodes = [
            NodeInfo(
                name=f"c{c}-t4-{i}", flavor="t4-spot", gpu=4, cpu_milli=32_000, memory=128 * GiB
            )
            for i in range(3)
        ] + [
            NodeInfo(
                name=f"c{c}-a100-{i}", flavor="a100", gpu=4, cpu_milli=32_000, memory=128 * GiB
            )
            for i in range(2)
        ]
        fleet.append((f"c{c}", flavors, nodes))
    plan = []
    for i in range(jobs):
        queue = QUEUES[i % 2]
        spec = JobSpec(
            name=f"storm{i}",
            job_id=f"storm-{i}",
            queue=queue,
            priority=rng.choice([0, 0, 0, 10]),
            gang=[
                PodSet(name="worker", replicas=1, gpu=rng.choice([1, 2, 4]), cpu="1", memory="1Gi")
            ],
            gpu_types=["t4"] if queue == "ml-batch-queue" else [],
            checkpoint=CheckpointSpec(uri=f"mem://storm-{i}"),
        )
        plan.append((rng.uniform(0.0, 10.0), spec, rng.uniform(5.0, 30.0)))
    return Scenario(fleet=fleet, jobs=plan)


def run(jobs: int, seed: int = 0, config: BrokerConfig | None = None) -> dict[str, float]:
    """Run the burst to the end; figures of reclaim churn."""
    w = World(
        seed,
        faults=QUIET,
        config=config if config is not None else team_config(),
        fault_window_s=0.0,
        horizon_s=20_000.0,
        scenario=team_scenario(jobs, seed),
        check_every=50,
        tolerate=frozenset({"completed-twice"}),
    )
    w.run()
    attempts = Counter({j: r.attempt for j, r in w.machine.jobs.items()})
    top = attempts.most_common(1)
    return {
        "jobs": jobs,
        "reclaimed_cancels": w.stats["cancel:reclaimed"],
        "jobs_reclaimed": len(w.reclaims),
        "most_reclaims_of_one_job": max(w.reclaims.values(), default=0),
        "max_attempts": top[0][1] if top else 0,
        "completed_twice": w.stats["completed-twice"],
        "makespan_s": round(w.clock.now - w.started, 1),
    }


app = program()


@app.command(help=summary(__doc__))
def reclaim_storm(
    jobs: Annotated[int, typer.Option(min=1)] = 2000,
    seed: int = 0,
    min_runtime_s: Annotated[
        float | None, typer.Option(min=0.0, help="override the config's")
    ] = None,
) -> None:
    t0 = time.monotonic()
    out = run(jobs, seed, team_config(min_runtime_s))
    for k, v in out.items():
        print(f"{k:28} {v}")
    print(f"{'wall_s':28} {time.monotonic() - t0:.1f}")


if __name__ == "__main__":
    app(prog_name="python -m load.reclaim_storm")
